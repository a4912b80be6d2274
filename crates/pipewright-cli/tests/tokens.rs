//! A user's corpus end to end: `data tokenizer`, `data prepare`, then `train --task tokens`
//! over pp2 x dp2 writes the serial run's losses, and a run resumed mid-epoch the losses of
//! the uninterrupted one, bit for bit (it reads the same tokens); the Llama trains on it over
//! pp2 x tp2 to its serial losses.

mod common;

use std::path::Path;

use common::{corpus, losses, text, tmp, train};

#[test]
fn a_corpus_trains_on_any_layout_and_resumes_on_the_same_tokens() {
    let dir = tmp("tokens");
    let (_, shards) = corpus(&dir, 512);
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let base = [
        "--task",
        "tokens",
        "--data",
        &s(&shards),
        "--block-size",
        "32",
        "--n-layer",
        "2",
        "--n-head",
        "2",
        "--n-embd",
        "32",
        "--batch-size",
        "16",
        "--eval-every",
        "1000",
        "--lr-schedule",
        "constant",
    ];
    let with = |extra: &[&str], out: &Path| {
        let mut a: Vec<String> = base.iter().map(|v| v.to_string()).collect();
        a.extend(extra.iter().map(|v| v.to_string()));
        a.extend(["--out".to_string(), s(out)]);
        let o = train(&a.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(o.status.success(), "{}", text(&o));
        losses(out)
    };
    let serial = with(&["--chunks", "4", "--steps", "6"], &dir.join("serial"));
    let layout = with(
        &["--pp", "2", "--dp", "2", "--chunks", "2", "--steps", "6"],
        &dir.join("pp2dp2"),
    );
    assert_eq!(serial.len(), 6);
    for (a, b) in serial.iter().zip(&layout) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "{serial:?} vs {layout:?}");
    }
    assert!(serial[5] < serial[0], "it learns: {serial:?}");
    // Stopped after 3 steps and resumed: the same tokens, the same losses, bit for bit.
    let parts = dir.join("parts");
    with(
        &["--chunks", "4", "--steps", "3", "--checkpoint-every", "3"],
        &parts,
    );
    let resumed = with(
        &["--chunks", "4", "--steps", "6", "--resume", "latest"],
        &parts,
    );
    assert_eq!(resumed, serial);
    // The Llama (grouped-query: 2 key/value heads for 4 query heads) over pp2 x tp2.
    let llama = [
        "--model",
        "llama",
        "--n-head",
        "4",
        "--n-kv-head",
        "2",
        "--steps",
        "4",
    ];
    let serial = with(
        &[&llama[..], &["--chunks", "4"]].concat(),
        &dir.join("llama"),
    );
    let split = with(
        &[&llama[..], &["--pp", "2", "--tp", "2", "--chunks", "4"]].concat(),
        &dir.join("llama-pp2tp2"),
    );
    for (a, b) in serial.iter().zip(&split) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "{serial:?} vs {split:?}");
    }
    // Without shards: a clear error.
    let o = train(&["--task", "tokens", "--out", &s(&dir.join("none"))]);
    assert!(!o.status.success() && text(&o).contains("--task tokens needs --data DIR"));
}

#[test]
fn ids_of_another_tokenizer_are_refused() {
    let dir = tmp("other-tokenizer");
    let (_, mine) = corpus(&dir.join("mine"), 512);
    let (theirs_tok, theirs) = corpus(&dir.join("theirs"), 300);
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let out = dir.join("run");
    let run = |data: &Path, steps: &str, extra: &[&str]| {
        let mut a = vec![
            "--task".to_string(),
            "tokens".into(),
            "--data".into(),
            s(data),
            "--block-size".into(),
            "16".into(),
            "--n-layer".into(),
            "1".into(),
            "--n-embd".into(),
            "16".into(),
            "--batch-size".into(),
            "8".into(),
            "--steps".into(),
            steps.into(),
            "--checkpoint-every".into(),
            "2".into(),
            "--out".into(),
            s(&out),
        ];
        a.extend(extra.iter().map(|e| e.to_string()));
        train(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let o = run(&mine, "2", &[]);
    assert!(o.status.success(), "{}", text(&o));
    // Resumed on shards of another tokenizer: refused, not trained on garbage.
    let o = run(&theirs, "4", &["--resume", "latest"]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("another tokenizer"), "{}", text(&o));
    // Generation decoding with another tokenizer: refused.
    let o = common::run(&[
        "generate",
        "--checkpoint",
        &s(&out.join("checkpoints")),
        "--tokenizer",
        &s(&theirs_tok),
        "--prompt",
        "fn ",
    ]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("not the tokenizer the checkpoint"),
        "{}",
        text(&o)
    );
}
