//! What the command-line tests share: a fresh temporary directory, running the binary, and
//! its output as text.
// Each test binary uses some of it.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// A path in the temporary directory for this test process, removed if it exists.
pub fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pw-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// A GPT small enough for a run of a few steps in a fraction of a second.
pub const TINY: &[&str] = &[
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "16",
    "--batch-size",
    "8",
    "--eval-every",
    "3",
];

/// The `pipewright` binary with one thread for its arithmetic. Tests run side by side, about
/// one per core, and candle's pools spin while they wait: two processes each sizing its pool
/// for the whole machine take turns on the cores and each runs several times slower.
pub fn pipewright() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pipewright"));
    c.env("RAYON_NUM_THREADS", "1");
    c
}

/// `pipewright train ARGS`.
pub fn train(args: &[&str]) -> Output {
    pipewright()
        .arg("train")
        .args(args)
        .output()
        .expect("runs the binary")
}

/// Its standard output, then its standard error.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `pipewright ARGS`.
pub fn run(args: &[&str]) -> Output {
    pipewright().args(args).output().expect("runs the binary")
}

/// `args` fails with a message holding `says`, as an error (an exit code), never a signal.
pub fn refused(args: &[&str], says: &str) {
    let o = run(args);
    assert!(!o.status.success(), "{args:?} succeeded:\n{}", text(&o));
    assert!(
        o.status.code().is_some(),
        "{args:?} ended by a signal:\n{}",
        text(&o)
    );
    assert!(
        text(&o).contains(says),
        "{args:?}: expected `{says}` in:\n{}",
        text(&o)
    );
    assert!(!text(&o).contains("panicked"), "{}", text(&o));
}

/// The losses of a run directory's `scalars.csv`, one per step.
pub fn losses(out: &std::path::Path) -> Vec<f64> {
    std::fs::read_to_string(out.join("scalars.csv"))
        .unwrap()
        .lines()
        .skip(1)
        .map(|l| l.split(',').nth(1).unwrap().parse().unwrap())
        .collect()
}

/// A tokenizer of `vocab` tokens trained on the library's pipeline sources, and those sources
/// prepared into token shards, in `dir`: (tokenizer.json, shard directory).
pub fn corpus(dir: &std::path::Path, vocab: usize) -> (PathBuf, PathBuf) {
    std::fs::create_dir_all(dir).unwrap();
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../pipewright/src/parallel/pipeline");
    let (tok, shards) = (dir.join("tok.json"), dir.join("shards"));
    let s = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let v = vocab.to_string();
    let o = run(&[
        "data",
        "tokenizer",
        "--vocab-size",
        &v,
        "--out",
        &s(&tok),
        &s(&src),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = run(&[
        "data",
        "prepare",
        "--tokenizer",
        &s(&tok),
        "--out",
        &s(&shards),
        &s(&src),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("held-out tokens"), "{}", text(&o));
    (tok, shards)
}

/// The losses the separate serial trainer takes over the run in `out`
/// ([`pipewright_models::parity::serial_losses`] of the run its `params.json` records): the
/// oracle the command's runs are held to (a run at one rank is the engine under test).
pub fn serial_losses(out: &std::path::Path) -> Vec<f64> {
    let params: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("params.json")).unwrap()).unwrap();
    let spec: pipewright_models::RunSpec = serde_json::from_value(params["spec"].clone()).unwrap();
    pipewright_models::parity::serial_losses(&spec).unwrap()
}
