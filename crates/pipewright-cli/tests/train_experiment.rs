//! `pipewright train` is an experiment: pystematic's standard parameters beside its flags, a
//! `parameters.json` that reruns a run exactly, runs under `--output-dir` when no `--out` is
//! given, and `--debug` naming the first layer that produced NaN or inf.

mod common;

use std::path::{Path, PathBuf};

use common::{text, tmp, train, TINY};

/// The common tiny GPT, for six steps.
fn tiny() -> Vec<&'static str> {
    let mut a = TINY.to_vec();
    a.extend(["--steps", "6"]);
    a
}

/// `scalars.csv` without its header: step, loss, learning rate and metric of every row.
fn scalars(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("scalars.csv"))
        .unwrap()
        .lines()
        .skip(1)
        .map(str::to_string)
        .collect()
}

fn parameters(dir: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(dir.join("parameters.json")).unwrap()).unwrap()
}

#[test]
fn parameters_json_reruns_a_run_exactly_and_the_command_line_wins() {
    let (a, b, c) = (tmp("a"), tmp("b"), tmp("c"));
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let mut first: Vec<String> = tiny().iter().map(|v| v.to_string()).collect();
    first.extend(
        [
            "--dropout",
            "0.1",
            "--seed",
            "5",
            "--pp",
            "2",
            "--chunks",
            "2",
            "--async-checkpoint",
            "--checkpoint-every",
            "2",
            "--out",
        ]
        .map(String::from),
    );
    first.push(s(&a));
    let first: Vec<&str> = first.iter().map(String::as_str).collect();
    let o = train(&first);
    assert!(o.status.success(), "{}", text(&o));
    let p = parameters(&a);
    // Every value, the standard parameters and the flags (`--seed` is `random_seed`).
    assert_eq!(
        (&p["random_seed"], &p["pp"], &p["dropout"], &p["debug"]),
        (
            &serde_json::json!(5),
            &serde_json::json!(2),
            &serde_json::json!(0.1),
            &serde_json::json!(false)
        ),
        "{p}"
    );
    let file = a.join("parameters.json");
    let o = train(&["--params-file", &s(&file), "--out", &s(&b)]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(scalars(&a).len(), 6);
    assert_eq!(scalars(&a), scalars(&b), "the same run, bit for bit");
    // Every value came through the file (numbers, strings, nulls and flags), but the run
    // directory, which the command line named.
    let (mut pa, mut pb) = (parameters(&a), parameters(&b));
    assert_eq!(pb["async_checkpoint"], true);
    pa["out"] = serde_json::Value::Null;
    pb["out"] = serde_json::Value::Null;
    assert_eq!(pa, pb);
    let o = train(&["--params-file", &s(&file), "--seed", "6", "--out", &s(&c)]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(parameters(&c)["random_seed"], 6);
    assert_eq!(
        parameters(&c)["pp"],
        2,
        "the file's value where no flag is given"
    );
    assert_ne!(scalars(&a)[0], scalars(&c)[0], "another seed, another run");
    for d in [a, b, c] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn without_out_runs_go_under_the_output_dir() {
    let root = tmp("root");
    let mut args = tiny();
    let r = root.to_str().unwrap();
    args.extend(["--output-dir", r]);
    for _ in 0..2 {
        let o = train(&args);
        assert!(o.status.success(), "{}", text(&o));
    }
    let runs: Vec<PathBuf> = std::fs::read_dir(root.join("train"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(runs.len(), 2, "one directory per run: {runs:?}");
    for run in &runs {
        assert_eq!(scalars(run).len(), 6);
        assert!(run.join("summary.json").exists());
    }
    let o = train(&["--help"]);
    assert!(o.status.success());
    for flag in [
        "--params-file",
        "--random-seed",
        "--checkpoint",
        "--chunk-size",
        "--pp",
    ] {
        assert!(text(&o).contains(flag), "--help lacks {flag}: {}", text(&o));
    }
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn debug_names_the_first_layer_that_diverged() {
    let (out, plain) = (tmp("debug"), tmp("plain"));
    let mut args = tiny();
    args.extend(["--lr", "1e30", "--clip", "0", "--lr-schedule", "constant"]);
    let with = |extra: &[&str]| {
        let mut a = args.clone();
        a.extend_from_slice(extra);
        train(&a)
    };
    let r = with(&["--debug", "--out", out.to_str().unwrap()]);
    assert!(!r.status.success());
    assert!(
        text(&r).contains("layer `h.0` produced NaN or inf values in micro-batch 0 of step 2"),
        "{}",
        text(&r)
    );
    // Without --debug only the loss is checked: it names no layer.
    let r = with(&["--out", plain.to_str().unwrap()]);
    assert!(!r.status.success());
    assert!(text(&r).contains("loss is NaN at step 2"), "{}", text(&r));
    assert!(!text(&r).contains("layer `h.0`"), "{}", text(&r));
    let _ = std::fs::remove_dir_all(out);
    let _ = std::fs::remove_dir_all(plain);
}
