//! A run owns its run directory and its checkpoint directory: another run, one after the
//! other, is refused there, and so is a directory that is not a run's; the run itself goes on
//! there (a resume), also in directories written before owner files existed.

mod common;

use std::path::Path;

use common::{text, tmp, train, TINY};

/// `pipewright train` of `steps` tiny steps, checkpointing every one, into `out` (and
/// `--checkpoint-dir ck` when given), with `more` flags.
fn run_into(out: &Path, ck: Option<&Path>, steps: &str, more: &[&str]) -> std::process::Output {
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(&["--steps", steps, "--checkpoint-every", "1"]);
    a.extend_from_slice(&["--out", out.to_str().unwrap()]);
    if let Some(ck) = ck {
        a.extend_from_slice(&["--checkpoint-dir", ck.to_str().unwrap()]);
    }
    a.extend_from_slice(more);
    train(&a)
}

fn refused_with(o: &std::process::Output, says: &str) {
    assert!(!o.status.success(), "accepted:\n{}", text(o));
    assert!(text(o).contains(says), "expected `{says}` in:\n{}", text(o));
    assert!(!text(o).contains("panicked"), "{}", text(o));
}

#[test]
fn a_checkpoint_directory_belongs_to_the_run_that_made_it() {
    let root = tmp("own-ck");
    let ck = root.join("shared-ck");
    let first = run_into(&root.join("a"), Some(&ck), "3", &[]);
    assert!(first.status.success(), "{}", text(&first));
    let latest = std::fs::read_to_string(ck.join("latest")).unwrap();
    let step3 = std::fs::read(ck.join("step-00000003/manifest.json")).unwrap();

    // Another run (another seed and run directory) into the same checkpoint directory.
    let second = run_into(&root.join("b"), Some(&ck), "2", &["--seed", "7"]);
    refused_with(&second, "holds the checkpoints of another run");
    assert_eq!(std::fs::read_to_string(ck.join("latest")).unwrap(), latest);
    assert_eq!(
        std::fs::read(ck.join("step-00000003/manifest.json")).unwrap(),
        step3
    );
    // Nor may a new run resume from there and save over them.
    let fork = run_into(&root.join("c"), Some(&ck), "5", &["--resume", "latest"]);
    refused_with(&fork, "--resume");
    assert_eq!(std::fs::read_to_string(ck.join("latest")).unwrap(), latest);

    // The run itself goes on there.
    let resumed = run_into(&root.join("a"), Some(&ck), "5", &["--resume", "latest"]);
    assert!(resumed.status.success(), "{}", text(&resumed));
    assert!(ck.join("step-00000005/manifest.json").exists());

    // Checkpoints saved before owner files existed are taken over by their run's resume, and
    // by no new run.
    std::fs::remove_file(ck.join(".pipewright-run")).unwrap();
    let new = run_into(&root.join("d"), Some(&ck), "2", &[]);
    refused_with(&new, "not empty and holds no checkpoints of this run");
    let old = run_into(&root.join("a"), Some(&ck), "6", &["--resume", "latest"]);
    assert!(old.status.success(), "{}", text(&old));
    assert!(ck.join(".pipewright-run").exists());
}

#[test]
fn a_run_writes_only_into_a_new_empty_or_own_directory() {
    let root = tmp("own-out");
    // A user's directory, with a file named as a run's picture would be.
    let mine = root.join("pictures");
    std::fs::create_dir_all(mine.join("images")).unwrap();
    let png = mine.join("images/train_loss_curve-2.png");
    std::fs::write(&png, b"the user's picture").unwrap();
    let o = run_into(&mine, None, "2", &[]);
    refused_with(&o, "is not a pipewright run directory");
    assert_eq!(std::fs::read(&png).unwrap(), b"the user's picture");
    assert!(!mine.join("scalars.csv").exists() && !mine.join(".lock").exists());

    // A checkpoint directory of other files.
    let o = run_into(&root.join("run"), Some(&mine), "2", &[]);
    refused_with(&o, "not empty and holds no checkpoints of this run");
    assert_eq!(std::fs::read(&png).unwrap(), b"the user's picture");
    assert!(!mine.join("latest").exists());

    // An empty directory is a new run's.
    let empty = root.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let o = run_into(&empty, None, "2", &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(empty.join(".pipewright-run").exists());
}
