//! The GPT experiment (`examples/gpt_experiment.rs`, included): a run resumed from the
//! context's checkpoint at pp=2 x tp=2 writes the uninterrupted run's losses, bit for bit, its
//! recorder filing them under the steps they belong to.

#[allow(dead_code)]
#[path = "../examples/gpt_experiment.rs"]
mod gpt_experiment;

use std::path::Path;

use gpt_experiment::experiment;

/// `train/loss` rows of a run's `tags.csv`: (count, value).
fn losses(run: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(run.join("tags.csv"))
        .unwrap()
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            (f[1] == "train/loss").then(|| (f[0].parse().unwrap(), f[2].parse().unwrap()))
        })
        .collect()
}

#[test]
fn the_gpt_experiment_resumes_bit_for_bit_at_pp2_tp2() {
    let dir = std::env::temp_dir().join(format!("pw-gptexp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let e = experiment();
    let run = |extra: &[&str]| {
        let mut a = vec![
            "gpt",
            "--output-dir",
            dir.to_str().unwrap(),
            "--distributed",
        ];
        a.extend([
            "--nproc-per-node",
            "4",
            "--pp",
            "2",
            "--tp",
            "2",
            "--chunks",
            "2",
        ]);
        a.extend([
            "--n-embd",
            "16",
            "--n-head",
            "2",
            "--batch-size",
            "8",
            "--eval-every",
            "3",
        ]);
        a.extend(extra);
        e.run(&e.parse(a).unwrap()).unwrap()
    };
    let whole = run(&["--steps", "6"]);
    let first = run(&["--steps", "3", "--checkpoint-every", "3"]);
    let ckpt = first.join("checkpoints");
    let second = run(&["--steps", "6", "--checkpoint", ckpt.to_str().unwrap()]);
    let (w, a, b) = (losses(&whole), losses(&first), losses(&second));
    assert_eq!(
        w.iter().map(|r| r.0).collect::<Vec<_>>(),
        (1..=6).collect::<Vec<_>>()
    );
    assert_eq!(a, w[..3]);
    assert_eq!(
        b,
        w[3..],
        "resumed: steps 4-6 with the uninterrupted run's losses"
    );
    assert!(second.join("images/train_loss_curve-6.png").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}
