//! Resuming loses nothing. A damaged newest checkpoint is not the end of a run: `--resume
//! latest` passes over it (a flipped byte, a missing part, a truncated file, an empty
//! `latest`), names it, and goes on from the newest intact one, ending bit for bit where a run
//! resumed from that one by name ends; a checkpoint named explicitly stays strict. `--keep`
//! after a rollback keeps what `latest` names; a checkpoint directory belongs to one run; a
//! resume with no steps left is refused before anything is written.

mod common;

use std::path::{Path, PathBuf};

use common::{losses, text, tmp, train, TINY};

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        let dst = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).unwrap();
        }
    }
}

/// `train TINY --steps STEPS --checkpoint-every 2 --out OUT [extra]`, which must succeed; its
/// output as text.
fn run(out: &Path, steps: &str, extra: &[&str]) -> String {
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(&["--steps", steps, "--checkpoint-every", "2", "--out"]);
    a.push(out.to_str().unwrap());
    a.extend_from_slice(extra);
    let o = train(&a);
    assert!(o.status.success(), "{a:?}:\n{}", text(&o));
    text(&o)
}

/// The largest safetensors file of a checkpoint (a rank's tensors).
fn part(step: &Path) -> PathBuf {
    std::fs::read_dir(step)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .max_by_key(|p| p.metadata().unwrap().len())
        .unwrap()
}

fn flip_a_byte(ck: &Path) {
    let p = part(&ck.join("step-00000006"));
    let mut b = std::fs::read(&p).unwrap();
    let mid = b.len() - 9;
    b[mid] ^= 0x10;
    std::fs::write(p, b).unwrap();
}

fn remove_a_part(ck: &Path) {
    std::fs::remove_file(part(&ck.join("step-00000006"))).unwrap();
}

fn truncate_a_file(ck: &Path) {
    let p = part(&ck.join("step-00000006"));
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(p.metadata().unwrap().len() / 2).unwrap();
}

fn empty_latest(ck: &Path) {
    std::fs::write(ck.join("latest"), "").unwrap();
}

/// Every file of `a` has the bytes of the same file in `b`.
fn same_files(a: &Path, b: &Path) {
    for e in std::fs::read_dir(a).unwrap().flatten() {
        let (x, y) = (
            std::fs::read(e.path()).unwrap(),
            std::fs::read(b.join(e.file_name())),
        );
        assert_eq!(Some(x), y.ok(), "{} differs", e.path().display());
    }
}

#[test]
fn resume_latest_passes_over_a_damaged_newest_checkpoint() {
    let base = tmp("fb-base");
    run(&base, "6", &[]);
    type Damage = fn(&Path);
    let cases: [(&str, Damage, &str, &str); 4] = [
        (
            "flip",
            flip_a_byte,
            "skipped step-00000006",
            "step-00000004",
        ),
        (
            "missing",
            remove_a_part,
            "skipped step-00000006",
            "step-00000004",
        ),
        (
            "truncated",
            truncate_a_file,
            "skipped step-00000006",
            "step-00000004",
        ),
        // With no step named, the newest intact one goes on.
        ("latest", empty_latest, "skipped latest", "step-00000006"),
    ];
    for (name, damage, says, from) in cases {
        let (d, r) = (tmp(&format!("fb-{name}")), tmp(&format!("fb-{name}-ref")));
        copy_dir(&base, &d);
        copy_dir(&base, &r);
        damage(&d.join("checkpoints"));
        let said = run(&d, "8", &["--resume", "latest"]);
        assert!(said.contains(says), "{name}: {said}");
        assert!(said.contains("resuming from `"), "{name}: {said}");
        let by_name = r.join("checkpoints").join(from);
        run(&r, "8", &["--resume", by_name.to_str().unwrap()]);
        let text_of = |p: &Path| std::fs::read_to_string(p.join("scalars.csv")).unwrap();
        assert_eq!(text_of(&d), text_of(&r), "{name}: the losses of both runs");
        same_files(
            &d.join("checkpoints/step-00000008"),
            &r.join("checkpoints/step-00000008"),
        );
    }
}

#[test]
fn a_damaged_checkpoint_named_explicitly_fails() {
    let out = tmp("fb-strict");
    run(&out, "6", &[]);
    flip_a_byte(&out.join("checkpoints"));
    let named = out.join("checkpoints/step-00000006");
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(&["--steps", "8", "--resume", named.to_str().unwrap(), "--out"]);
    a.push(out.to_str().unwrap());
    let o = train(&a);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("damaged"), "{}", text(&o));
    // And with nothing intact, latest names every checkpoint it passed over.
    for s in ["step-00000002", "step-00000004"] {
        let p = part(&out.join("checkpoints").join(s));
        std::fs::write(p, b"x").unwrap();
    }
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(&["--steps", "8", "--resume", "latest", "--out"]);
    a.push(out.to_str().unwrap());
    let o = train(&a);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t.contains("no intact checkpoint"), "{t}");
    for s in ["step-00000002", "step-00000004", "step-00000006"] {
        assert!(t.contains(&format!("skipped {s}")), "{t}");
    }
}

/// `train TINY ARGS` into `out`, which must fail saying `says`.
fn refused(out: &Path, args: &[&str], says: &str) {
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(args);
    a.extend_from_slice(&["--out", out.to_str().unwrap()]);
    let o = train(&a);
    assert!(!o.status.success(), "{a:?} succeeded:\n{}", text(&o));
    assert!(text(&o).contains(says), "{a:?}: {}", text(&o));
}

#[test]
fn keep_after_a_rollback_keeps_what_latest_names() {
    let out = tmp("rollback");
    run(&out, "10", &["--keep", "3"]);
    let from = out.join("checkpoints/step-00000006");
    let o = out.to_str().unwrap();
    let mut a: Vec<&str> = TINY.to_vec();
    let f = from.to_str().unwrap();
    a.extend_from_slice(&["--steps", "8", "--checkpoint-every", "1", "--keep", "1"]);
    a.extend_from_slice(&["--resume", f, "--out", o]);
    let r = train(&a);
    assert!(r.status.success(), "{}", text(&r));
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    assert_eq!(latest.trim(), "step-00000008");
    assert!(out.join("checkpoints/step-00000008/manifest.json").exists());
    // The abandoned run's later checkpoint is left, not pruned in this run's place.
    assert!(out.join("checkpoints/step-00000010").exists());
    assert!(!out.join("checkpoints/step-00000007").exists());
    run(&out, "9", &["--resume", "latest"]);
    assert_eq!(losses(&out).len(), 9);
}

#[test]
fn a_checkpoint_directory_belongs_to_one_run() {
    let (a, b) = (tmp("shared-a"), tmp("shared-b"));
    let shared = tmp("shared-ck");
    let s = shared.to_str().unwrap();
    run(&a, "4", &["--checkpoint-dir", s, "--keep", "1"]);
    // While a run holds it, another is refused (its lock, as a run directory's).
    std::fs::write(
        shared.join(".lock"),
        format!("{} {}", std::process::id(), host()),
    )
    .unwrap();
    refused(
        &b,
        &["--steps", "4", "--checkpoint-dir", s],
        "is in use by another run",
    );
    std::fs::remove_file(shared.join(".lock")).unwrap();
    // A directory inside another run's is refused too.
    let inside = a.join("mine");
    let i = inside.to_str().unwrap();
    refused(
        &b,
        &["--steps", "4", "--checkpoint-dir", i],
        "the directory of another run",
    );
    assert!(
        !b.join("parameters.json").exists(),
        "nothing written by a refused run"
    );
}

fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

#[test]
fn a_resume_with_no_steps_left_is_refused() {
    let out = tmp("no-steps-left");
    run(&out, "6", &[]);
    let rows = std::fs::read(out.join("scalars.csv")).unwrap();
    let summary = std::fs::read(out.join("summary.json")).unwrap();
    for steps in ["4", "6"] {
        refused(
            &out,
            &["--steps", steps, "--resume", "latest"],
            "nothing is left to train",
        );
    }
    // Into a new run directory too.
    let ck = out.join("checkpoints/step-00000006");
    let other = tmp("no-steps-left-new");
    refused(
        &other,
        &["--steps", "6", "--resume", ck.to_str().unwrap()],
        "give --steps above 6",
    );
    assert_eq!(std::fs::read(out.join("scalars.csv")).unwrap(), rows);
    assert_eq!(std::fs::read(out.join("summary.json")).unwrap(), summary);
}

#[test]
fn outputs_inside_a_checkpoint_or_a_live_run_are_refused() {
    let out = tmp("inside");
    run(&out, "2", &[]);
    let step = out.join("checkpoints/step-00000002");
    refused(&step.join("run"), &["--steps", "2"], "is inside");
    assert!(!step.join("run").exists());
    // ckpt reshard into a directory under a run in progress (its lock).
    std::fs::write(
        out.join(".lock"),
        format!("{} {}", std::process::id(), host()),
    )
    .unwrap();
    let into = out.join("checkpoints/resharded");
    let o = common::run(&[
        "ckpt",
        "reshard",
        out.join("checkpoints").to_str().unwrap(),
        "--tp",
        "2",
        "--out",
        into.to_str().unwrap(),
    ]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("a run in progress"), "{}", text(&o));
    assert!(!into.exists());
}

/// A resume without `--checkpoint-every` checkpoints as its run did (and keeps as many), and
/// records that, so a second resume goes on from the newest step, not from the first run's.
#[test]
fn a_resume_keeps_checkpointing_as_the_run_did() {
    let out = tmp("resume-keeps-interval");
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(&[
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--keep",
        "1",
        "--out",
    ]);
    a.push(out.to_str().unwrap());
    let o = train(&a);
    assert!(o.status.success(), "{}", text(&o));
    let mut b: Vec<&str> = TINY.to_vec();
    b.extend_from_slice(&["--steps", "8", "--resume", "latest", "--out"]);
    b.push(out.to_str().unwrap());
    let o = train(&b);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("checkpointing every 2 steps"),
        "{}",
        text(&o)
    );
    let latest = std::fs::read_to_string(out.join("checkpoints/latest")).unwrap();
    assert!(
        latest.trim().ends_with("step-00000008"),
        "latest names {latest}"
    );
    let steps: Vec<String> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert_eq!(steps, ["step-00000008"], "--keep 1 carried over too");
    let params = std::fs::read_to_string(out.join("parameters.json")).unwrap();
    assert!(params.contains("\"checkpoint_every\": 2"), "{params}");
}

#[test]
fn a_resume_goes_on_as_the_run_that_saved_it() {
    let out = tmp("same-run");
    run(&out, "4", &[]);
    for (flag, value) in [("--seed", "5"), ("--batch-size", "16")] {
        refused(
            &out,
            &["--steps", "6", "--resume", "latest", flag, value],
            &format!("the checkpoint's run trained with {flag}"),
        );
    }
    assert_eq!(losses(&out).len(), 4, "a refused resume writes no row");
    // A new learning rate is taken, and said.
    let said = run(&out, "6", &["--resume", "latest", "--lr", "1e-4"]);
    assert!(
        said.contains("the learning rate changes on resuming"),
        "{said}"
    );
    assert_eq!(losses(&out).len(), 6);
}

#[test]
fn a_run_written_before_the_typed_sections_resumes_where_it_would_have_gone() {
    // A run of 901bbdb's build (tests/fixtures/run-901bbdb/make.sh), stopped at step 2: flags
    // as text in params.json, a flat TrainSpec in its checkpoint's meta.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/run-901bbdb");
    let out = tmp("before-sections");
    copy_dir(&fixture, &out);
    let flags = [
        "--model",
        "gpt",
        "--task",
        "adder",
        "--steps",
        "4",
        "--batch-size",
        "8",
        "--chunks",
        "2",
        "--n-layer",
        "2",
        "--n-embd",
        "16",
        "--n-head",
        "2",
        "--pp",
        "2",
        "--dp",
        "2",
        "--zero",
        "1",
        "--recompute",
        "always",
        "--precision",
        "bf16",
        "--balance",
        "2,2",
        "--checkpoint-every",
        "2",
        "--eval-every",
        "2",
        "--lr-schedule",
        "constant",
        "--bucket-mb",
        "1",
        "--resume",
        "latest",
        "--out",
    ];
    let mut a = flags.to_vec();
    a.push(out.to_str().unwrap());
    let o = train(&a);
    assert!(o.status.success(), "{}", text(&o));
    // Steps 3 and 4 bit for bit as that build went on to train them.
    let expected: Vec<f64> = std::fs::read_to_string(fixture.join("expected-steps-3-4.csv"))
        .unwrap()
        .lines()
        .map(|l| l.split(',').nth(1).unwrap().parse().unwrap())
        .collect();
    assert_eq!(losses(&out)[2..], expected[..]);
    // Today's record of the same flags is that build's, key for key (the run's spec too).
    let read = |p: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(p.join("params.json")).unwrap()).unwrap()
    };
    let (mut old, new) = (read(&fixture), read(&out));
    // One form changed since: the spec records its balance as the flag's text, which the
    // record of the flags always did (`{"layers": [2, 2]}` -> `"2,2"`; both read).
    assert_eq!(
        old["spec"]["balance"],
        serde_json::json!({"layers": [2, 2]})
    );
    old["spec"]["balance"] = "2,2".into();
    for (k, v) in old.as_object().unwrap() {
        if !["out", "resume", "pipewright_version"].contains(&k.as_str()) {
            assert_eq!(&new[k], v, "params.json `{k}`");
        }
    }
}
