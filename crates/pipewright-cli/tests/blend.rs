//! Two prepared corpora blended 0.7/0.3 (`train --task tokens --data 0.7:A,0.3:B`): each
//! dataset's held-out perplexity is recorded and the run's metric blends them by weight; pp2 x
//! dp2 writes the serial run's losses, a run resumed mid-epoch the uninterrupted one's bit for
//! bit, and corpora of different tokenizers are refused before anything is written.

mod common;

use std::path::Path;

use common::{corpus, losses, run, text, tmp, train};

#[test]
fn a_blend_trains_on_any_layout_and_resumes_on_the_same_rows() {
    let dir = tmp("blend");
    let (tok, web) = corpus(&dir, 512);
    let s = |p: &Path| p.to_str().unwrap().to_string();
    // The second corpus: JSON lines of other sources, with the same tokenizer.
    let docs: String = ["scheduling", "simulation", "partition"]
        .iter()
        .map(|t| {
            format!(
                "{}\n",
                serde_json::json!({"text": format!("{t} ").repeat(400)})
            )
        })
        .collect();
    std::fs::write(dir.join("code.jsonl"), docs).unwrap();
    let code = dir.join("code");
    let o = run(&[
        "data",
        "prepare",
        "--tokenizer",
        &s(&tok),
        "--out",
        &s(&code),
        &s(&dir.join("code.jsonl")),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let data = format!("0.7:{},0.3:{}", s(&web), s(&code));
    let base = [
        "--task",
        "tokens",
        "--data",
        &data,
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
        "3",
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
    // Each dataset's held-out perplexity at each evaluation (tags.csv), and the run's metric
    // (scalars.csv) their blend by weight: exp(0.7 ln p_web + 0.3 ln p_code).
    let tags = std::fs::read_to_string(dir.join("serial/tags.csv")).unwrap();
    let part = |step: &str, name: &str| -> f64 {
        let key = format!("{step},metric/{name},");
        let line = tags
            .lines()
            .find(|l| l.starts_with(&key))
            .unwrap_or_else(|| {
                panic!("no `{key}` in tags.csv:\n{tags}");
            });
        line[key.len()..].parse().unwrap()
    };
    let scalars = std::fs::read_to_string(dir.join("serial/scalars.csv")).unwrap();
    for step in ["3", "6"] {
        let metric: f64 = scalars
            .lines()
            .find(|l| l.starts_with(&format!("{step},")))
            .and_then(|l| l.rsplit(',').next()?.parse().ok())
            .unwrap();
        let blended = (0.7 * part(step, "shards").ln() + 0.3 * part(step, "code").ln()).exp();
        assert!(
            (metric - blended).abs() < 1e-9 * metric,
            "step {step}: {metric} vs {blended}"
        );
    }
    for (a, b) in serial.iter().zip(&layout) {
        assert!((a - b).abs() <= 1e-5 * a.abs(), "{serial:?} vs {layout:?}");
    }
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
    // Another tokenizer's corpus: refused, nothing written.
    let (_, theirs) = corpus(&dir.join("theirs"), 300);
    let bad = format!("0.5:{},0.5:{}", s(&web), s(&theirs));
    let none = dir.join("none");
    let o = train(&["--task", "tokens", "--data", &bad, "--out", &s(&none)]);
    assert!(!o.status.success());
    assert!(text(&o).contains("different tokenizers"), "{}", text(&o));
    assert!(!none.exists());
}

#[test]
fn data_windows_lists_a_blends_rows_by_source() {
    let dir = tmp("blend-windows");
    let (_, shards) = corpus(&dir, 300);
    let s = shards.to_str().unwrap();
    let list = |data: &str, name: &str, rows: &str| -> Vec<String> {
        let out = dir.join(name);
        let o = run(&[
            "data",
            "windows",
            "--data",
            data,
            "--block-size",
            "16",
            "--batch-size",
            rows,
            "--steps",
            "1",
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", text(&o));
        let csv = std::fs::read_to_string(out).unwrap();
        let row = csv.lines().nth(1).unwrap().split_once(',').unwrap().1;
        row.split(' ').map(String::from).collect()
    };
    // Equal weights alternate the sources, the first first; source 0's rows are the
    // dataset's own rows, in order.
    let blend = list(&format!("1:{s},1:{s}"), "blend.csv", "4");
    let alone = list(s, "alone.csv", "2");
    let sources: Vec<&str> = blend.iter().map(|r| r.split(':').next().unwrap()).collect();
    assert_eq!(sources, ["0", "1", "0", "1"], "{blend:?}");
    assert_eq!(
        [blend[0].as_str(), blend[2].as_str()],
        [format!("0:{}", alone[0]), format!("0:{}", alone[1])],
        "{blend:?} against {alone:?}"
    );
}
