//! Bad input and limits are clear errors, never a panic, an abort or an out-of-memory kill:
//! a diverging f16 run, overflowing costs, state of another optimizer, flags the run does not
//! use, models and schedules too large for the memory, numbers that are not numbers.

mod common;

use common::{refused, run, text, tmp};

#[test]
fn bad_input_and_limits_are_clear_errors() {
    let dir = tmp("bad");
    let out = |n: &str| dir.join(n).to_str().unwrap().to_string();
    let small = [
        "train",
        "--n-layer",
        "1",
        "--n-embd",
        "16",
        "--batch-size",
        "8",
    ];
    let with = |extra: &[&str]| -> Vec<String> {
        small.iter().chain(extra).map(|s| s.to_string()).collect()
    };
    let check = |args: Vec<String>, says: &str| {
        refused(&args.iter().map(String::as_str).collect::<Vec<_>>(), says)
    };
    // 8. f16 diverging stops and says so.
    const F16: &[&str] = &[
        "--precision",
        "f16",
        "--lr",
        "1e4",
        "--clip",
        "0",
        "--steps",
        "300",
    ];
    check(
        with(&[F16, &["--out", &out("f16")]].concat()),
        "the run diverged",
    );
    // 9. Costs whose sums overflow.
    refused(
        &["balance", "--costs", "1e308,1e308,1", "--partitions", "2"],
        "more than a balance can compare",
    );
    // 10. Silently accepted before.
    let ck = out("adamw");
    let o = run(
        &with(&["--steps", "2", "--checkpoint-every", "2", "--out", &ck])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(o.status.success(), "{}", text(&o));
    check(
        with(&[
            "--steps",
            "4",
            "--optimizer",
            "sgd",
            "--resume",
            "latest",
            "--out",
            &ck,
        ]),
        "saved by another optimizer",
    );
    check(
        with(&["--width", "32", "--out", &out("w")]),
        "does not use --width",
    );
    check(
        with(&["--task", "sort", "--digits", "3", "--out", &out("d")]),
        "does not use --digits",
    );
    check(
        with(&["--hardware", "/nope.json", "--out", &out("hw")]),
        "no hardware file",
    );
    let cnn = out("cnn");
    let o = run(&[
        "train",
        "--model",
        "cnn",
        "--task",
        "shapes",
        "--steps",
        "1",
        "--batch-size",
        "8",
        "--checkpoint-every",
        "1",
        "--out",
        &cnn,
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let cks = format!("{cnn}/checkpoints");
    refused(
        &[
            "ckpt",
            "reshard",
            &cks,
            "--tp",
            "2",
            "--out",
            &out("cnn-tp2"),
        ],
        "no tensor-parallel layers",
    );
    // 11. Limits checked up front, not by the kernel.
    check(
        with(&["--n-embd", "65536", "--out", &out("big")]),
        "more than the",
    );
    check(
        with(&[
            "--n-embd",
            "8192",
            "--n-head",
            "8",
            "--n-layer",
            "48",
            "--out",
            &out("big2"),
        ]),
        "more than the",
    );
    refused(
        &["schedule", "--pp", "100000", "--chunks", "100000"],
        "more than is simulated here",
    );
    refused(
        &[
            "train",
            "--model",
            "cnn",
            "--task",
            "shapes",
            "--batch-size",
            "100000000",
            "--out",
            &out("cnnb"),
        ],
        "more than the",
    );
    refused(
        &[
            "bench",
            "ckpt",
            "--n-layer",
            "100000",
            "--dir",
            &out("bench"),
        ],
        "more than the",
    );
    // 12. Say what was given and what is allowed.
    check(
        with(&["--lr", "nan", "--out", &out("nan")]),
        "must be a finite number, got `nan`",
    );
    check(
        with(&["--seed=-1", "--out", &out("seed")]),
        "--seed must be at least 0, got -1",
    );
    check(
        with(&["--vocab-size", "5", "--out", &out("v")]),
        "smaller than the task's vocabulary",
    );
    // An error a rank raised is that error, not "communication failed".
    let f16 = with(&[F16, &["--pp", "2", "--out", &out("f16-pp2")]].concat());
    let t = text(&run(&f16.iter().map(String::as_str).collect::<Vec<_>>()));
    assert!(t.contains("rank ") && t.contains("the run diverged"), "{t}");
    assert!(!t.contains("communication failed"), "{t}");
}

fn plan_cmd(args: &[&str]) -> std::process::Output {
    common::pipewright()
        .arg("plan")
        .args(args)
        .output()
        .expect("runs the binary")
}

/// A `--candidate` that cannot run is listed as refused, with why, beside the others'
/// predictions: the plan goes on (the interleaved schedule with one micro-batch a replica at
/// pp 2, a dp that does not divide the batch); the one that can run is predicted as it is
/// alone.
#[test]
fn a_candidate_that_cannot_run_is_refused_beside_the_others() {
    let good = "pp=2,dp=2,mbs=8";
    let alone = plan_cmd(&["--world", "4", "--candidate", good]);
    assert!(
        alone.status.success(),
        "{}",
        String::from_utf8_lossy(&alone.stderr)
    );
    let o = plan_cmd(&[
        "--world",
        "4",
        "--candidate",
        "pp=2,dp=2,mbs=32,schedule=interleaved,virtual=2",
        "--candidate",
        good,
        "--candidate",
        "pp=2,dp=3",
    ]);
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let row = |s: &str| -> String {
        let line = s
            .lines()
            .find(|l| l.starts_with("1 "))
            .expect("a ranked row");
        line.to_string()
    };
    assert_eq!(row(&out), row(&String::from_utf8_lossy(&alone.stdout)));
    assert!(!out.lines().any(|l| l.starts_with("2 ")), "{out}");
    assert!(
        out.contains("refused pp=2 tp=1 dp=2 mbs 32 interleaved v2: ")
            && out.contains("must be a multiple of pp 2"),
        "{out}"
    );
    assert!(
        out.contains("refused pp=2,dp=3: ") && out.contains("does not divide the global batch"),
        "{out}"
    );
    // Only refused candidates: an error that says why each was.
    let o = plan_cmd(&["--world", "4", "--candidate", "pp=2,dp=3"]);
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert!(
        !o.status.success() && err.contains("no candidate can run"),
        "{err}"
    );
}
