//! `train --init-from DIR`: a Hugging Face model directory (the fixtures transformers saved)
//! trains from its weights on any layout to the serial run's losses, and a run that barely
//! moves them exports them back as they were; a size flag beside it, or the wrong --model, is
//! a clear error.

mod common;

use std::path::{Path, PathBuf};

use common::{losses, run, text, tmp, train};
use pipewright::engine::checkpoint::{HfWeights, TensorPart};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../pipewright-models/tests/fixtures")
        .join(name)
}

fn trained(extra: &[&str], out: &Path) -> Vec<f64> {
    let mut a: Vec<&str> = vec![
        "--task",
        "adder",
        "--batch-size",
        "8",
        "--eval-every",
        "1000",
    ];
    a.extend_from_slice(extra);
    a.extend_from_slice(&["--out", out.to_str().unwrap()]);
    let o = train(&a);
    assert!(o.status.success(), "{}", text(&o));
    losses(out)
}

#[test]
fn pretrained_weights_train_on_any_layout_and_export_back() {
    let dir = tmp("init-from");
    for (model, fx, layouts) in [
        (
            "llama",
            "hf-llama",
            [&["--tp", "2"][..], &["--pp", "2", "--tp", "2"][..]],
        ),
        (
            "gpt",
            "hf-gpt2",
            [&["--pp", "2"][..], &["--tp", "2", "--dp", "2"][..]],
        ),
    ] {
        let f = fixture(fx);
        let init = [
            "--model",
            model,
            "--init-from",
            f.to_str().unwrap(),
            "--steps",
            "3",
        ];
        let serial = trained(
            &[&init[..], &["--chunks", "2"]].concat(),
            &dir.join(format!("{model}-serial")),
        );
        for (i, l) in layouts.iter().enumerate() {
            let chunks: &[&str] = if l.contains(&"--dp") {
                &["--chunks", "1"]
            } else {
                &["--chunks", "2"]
            };
            let got = trained(
                &[&init[..], l, chunks].concat(),
                &dir.join(format!("{model}-{i}")),
            );
            for (a, b) in serial.iter().zip(&got) {
                assert!(
                    (a - b).abs() <= 1e-5 * a.abs(),
                    "{model} {l:?}: {got:?} vs {serial:?}"
                );
            }
        }
        // Not the random initialisation's losses.
        let fresh = trained(
            &["--model", model, "--steps", "1"],
            &dir.join(format!("{model}-fresh")),
        );
        assert!((fresh[0] - serial[0]).abs() > 1e-3, "{fresh:?} {serial:?}");
    }
    // One step that cannot move the weights: exported, they are the pretrained ones.
    let f = fixture("hf-llama");
    let out = dir.join("still");
    trained(
        &[
            "--model",
            "llama",
            "--init-from",
            f.to_str().unwrap(),
            "--steps",
            "1",
            "--lr",
            "1e-12",
            "--weight-decay",
            "0",
            "--checkpoint-every",
            "1",
            "--tp",
            "2",
        ],
        &out,
    );
    let hf = dir.join("still-hf");
    let o = run(&[
        "ckpt",
        "export",
        out.join("checkpoints").to_str().unwrap(),
        "--format",
        "hf-llama",
        "--out",
        hf.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let (theirs, ours) = (HfWeights::open(&f).unwrap(), HfWeights::open(&hf).unwrap());
    assert_eq!(theirs.shapes(), ours.shapes());
    for name in theirs.shapes().keys() {
        let (a, b) = (
            theirs.read(name, TensorPart::WHOLE).unwrap(),
            ours.read(name, TensorPart::WHOLE).unwrap(),
        );
        let e = pipewright::model::nn::max_rel_diff(&a, &b).unwrap();
        assert!(e < 1e-6, "`{name}` moved by {e:e}");
    }
    // Errors.
    let fs = f.to_str().unwrap();
    let o = train(&[
        "--model",
        "llama",
        "--init-from",
        fs,
        "--n-layer",
        "3",
        "--out",
        dir.join("e1").to_str().unwrap(),
    ]);
    assert!(
        !o.status.success() && text(&o).contains("drop --n-layer"),
        "{}",
        text(&o)
    );
    let o = train(&["--init-from", fs, "--out", dir.join("e2").to_str().unwrap()]);
    assert!(
        !o.status.success() && text(&o).contains("pass --model llama"),
        "{}",
        text(&o)
    );
}
