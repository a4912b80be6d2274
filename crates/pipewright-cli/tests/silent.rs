//! Flags that would do nothing where they are given are refused, saying what they need: each
//! was accepted without a word before (and the run trained as if it were not there).

mod common;

use common::{refused, tmp};

#[test]
fn flags_that_would_do_nothing_are_refused() {
    let dir = tmp("silent");
    let out = dir.join("o");
    let o = out.to_str().unwrap();
    let train = |extra: &[&'static str]| -> Vec<&str> {
        let mut a = vec!["train", "--n-layer", "1", "--n-embd", "16", "--steps", "1"];
        a.extend_from_slice(extra);
        a.extend_from_slice(&["--out", o]);
        a
    };
    let cases: [(Vec<&str>, &str); 10] = [
        (train(&["--sequence-parallel"]), "give --tp 2 or more"),
        (train(&["--momentum", "0.5"]), "--momentum is SGD's"),
        (
            train(&["--optimizer", "sgd", "--beta2", "0.95"]),
            "are AdamW's",
        ),
        (
            train(&["--deferred-batch-norm"]),
            "only --model cnn has any",
        ),
        (train(&["--keep", "2"]), "--keep prunes the checkpoints"),
        (
            train(&["--async-checkpoint"]),
            "--async-checkpoint writes the checkpoints",
        ),
        (train(&["--backend", "mpi"]), "this layout has one"),
        (
            vec!["plan", "--world", "2", "--out", o],
            "plan alone writes nothing",
        ),
        (
            vec!["bench", "ckpt", "--n-layer", "1", "--dir", "/no/such/dir"],
            "is not a directory",
        ),
        (
            vec!["launch", "--nproc-per-node", "0", "--", "/bin/true"],
            "at least one",
        ),
    ];
    for (args, says) in &cases {
        refused(args, says);
        assert!(!out.exists(), "{args:?} wrote {}", out.display());
    }
    assert!(!std::path::Path::new("/no/such/dir").exists());
    // A negative number is a value its flag refuses, not an unknown argument.
    refused(
        &["generate", "--max-new-tokens", "-5", "--prompt-ids", "1"],
        "invalid value '-5' for '--max-new-tokens",
    );
    refused(&["schedule", "--pp", "-2"], "invalid value '-2' for '--pp");
}
