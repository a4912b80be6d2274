//! Long sequences from the command line: `--cp` (context parallelism) and
//! `--sequence-parallel` write the serial run's losses, a run saved at cp 2 resumes at cp 1,
//! and sequences that do not split are clear errors naming the fix.

mod common;

use std::path::Path;

use common::{text, tmp, train};

/// 4-digit sums: sequences of 12 tokens (2 x cp = 4 chunks at cp 2; 6 per rank, 3 per rank
/// and tensor-parallel rank).
const RUN: &[&str] = &[
    "--digits",
    "4",
    "--n-layer",
    "2",
    "--n-head",
    "4",
    "--n-embd",
    "16",
    "--batch-size",
    "8",
    "--chunk-size",
    "4",
    "--dropout",
    "0",
    "--eval-every",
    "1000",
    "--lr-schedule",
    "constant",
];

fn losses(out: &Path, extra: &[&str]) -> Vec<f64> {
    let mut a: Vec<&str> = RUN.to_vec();
    a.extend_from_slice(&["--out", out.to_str().unwrap()]);
    a.extend_from_slice(extra);
    let o = train(&a);
    assert!(o.status.success(), "{extra:?}: {}", text(&o));
    std::fs::read_to_string(out.join("scalars.csv"))
        .unwrap()
        .lines()
        .skip(1)
        .filter_map(|l| l.split(',').nth(1)?.parse::<f64>().ok())
        .collect()
}

fn close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (a, b) in got.iter().zip(want) {
        assert!(
            ((a - b) / b).abs() < 1e-5,
            "{what}: {got:?} vs serial {want:?}"
        );
    }
}

#[test]
fn context_and_sequence_parallel_runs_write_the_serial_losses() {
    let out = tmp("long-context");
    let serial = losses(&out, &["--steps", "4"]);
    for extra in [
        &["--cp", "2"][..],
        &["--cp", "2", "--pp", "2"],
        &["--tp", "2", "--sequence-parallel"],
        &["--cp", "2", "--tp", "2", "--dp", "2", "--sequence-parallel"],
    ] {
        let _ = std::fs::remove_dir_all(&out);
        let mut a = extra.to_vec();
        a.extend_from_slice(&["--steps", "4"]);
        close(&losses(&out, &a), &serial, &format!("{extra:?}"));
        let summary = std::fs::read_to_string(out.join("summary.json")).unwrap();
        if extra[0] == "--cp" {
            assert!(summary.contains("cp=2"), "{summary}");
        }
    }
    let _ = std::fs::remove_dir_all(out);
}

#[test]
fn a_run_saved_at_cp_2_resumes_at_cp_1() {
    let (whole, parts) = (tmp("cp-whole"), tmp("cp-parts"));
    let want = losses(&whole, &["--steps", "6"]);
    losses(
        &parts,
        &["--cp", "2", "--steps", "3", "--checkpoint-every", "3"],
    );
    let got = losses(&parts, &["--steps", "6", "--resume", "latest"]);
    close(&got, &want, "cp 2 then cp 1");
    for d in [whole, parts] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn sequences_that_do_not_split_are_clear_errors() {
    let out = tmp("cp-bad");
    let fails = |extra: &[&str], want: &str| {
        let mut a: Vec<&str> = RUN.to_vec();
        a.extend_from_slice(&["--out", out.to_str().unwrap(), "--steps", "1"]);
        a.extend_from_slice(extra);
        let o = train(&a);
        assert!(!o.status.success(), "{extra:?} must fail");
        assert!(text(&o).contains(want), "{extra:?}: {}", text(&o));
    };
    // 12 tokens do not split into 2 x 4 chunks.
    fails(&["--cp", "4"], "2 x cp = 8 chunks");
    fails(&["--cp", "4"], "a multiple of 8");
    fails(
        &["--cp", "2", "--dropout", "0.1"],
        "pass --dropout 0 with --cp 2",
    );
    fails(
        &[
            "--cp",
            "2",
            "--tp",
            "4",
            "--n-head",
            "4",
            "--vocab-size",
            "12",
            "--sequence-parallel",
        ],
        "splits each rank's 6 tokens over --tp 4",
    );
    let o = train(&[
        "--model", "cnn", "--task", "shapes", "--cp", "2", "--steps", "1",
    ]);
    assert!(text(&o).contains("use --cp 1"), "{}", text(&o));
    let _ = std::fs::remove_dir_all(out);
}
