//! Datasets blended by weight: over 1,000 steps each dataset gives its weight's share of the
//! rows (within one row); a step's rows are a pure function of the step (asked for cold, as a
//! resumed run does, they are the same); each dataset keeps its own epochs, every window once
//! an epoch; one dataset alone reads what it reads unblended; datasets of different tokenizers
//! are refused.

use std::path::{Path, PathBuf};

use pipewright::data::{prepare, Blend, Corpus, InvalidUtf8, PrepareOptions, Split, Tokenizer};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pw-blend-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A shard directory of `docs` documents about `topic`, encoded by `tok`.
fn dataset(dir: &Path, name: &str, tok: &Tokenizer, topic: &str, docs: usize) -> PathBuf {
    let text = dir.join(format!("{name}.jsonl"));
    let lines: String = (0..docs)
        .map(|i| {
            let t = format!(
                "{topic} number {i}: {}\n",
                format!("{topic} {i} ").repeat(20)
            );
            format!("{}\n", serde_json::json!({ "text": t }))
        })
        .collect();
    std::fs::write(&text, lines).unwrap();
    let out = dir.join(name);
    let opts = PrepareOptions {
        shard_tokens: 4096,
        held_out: 0.1,
        ..Default::default()
    };
    prepare(
        tok,
        &Corpus::new(vec![text]),
        &out,
        &opts,
        &mut |_, _, _| {},
    )
    .unwrap();
    out
}

#[test]
fn a_blend_draws_by_weight_and_each_dataset_keeps_its_epochs() {
    let d = tmp("draws");
    let seed_text = d.join("seed.txt");
    std::fs::write(&seed_text, "web pages and code files and books ".repeat(50)).unwrap();
    let (tok, _) = Tokenizer::train(
        &Corpus::new(vec![seed_text]),
        300,
        &d.join("tok.json"),
        InvalidUtf8::Error,
    )
    .unwrap();
    let web = dataset(&d, "web", &tok, "web page", 60);
    let code = dataset(&d, "code", &tok, "code file", 12);
    let blend = Blend::open(&[(0.7, web.clone()), (0.3, code.clone())]).unwrap();
    let (rows, block, seed) = (8usize, 16usize, 5u64);
    let all = blend.assign(0, 1000 * rows);
    let from = |s: usize| all.iter().filter(|(x, _)| *x == s).count() as f64;
    let n = all.len() as f64;
    assert!((from(0) / n - 0.7).abs() < 0.02 && (from(1) / n - 0.3).abs() < 0.02);
    // Within one row of the weights after any number of rows (Megatron's greedy blend).
    let mut counts = [0f64; 2];
    for (g, (s, k)) in all.iter().enumerate() {
        assert_eq!(
            *k as f64, counts[*s],
            "row {g}: the source's own row number"
        );
        counts[*s] += 1.0;
        let t = (g + 1) as f64;
        assert!((counts[0] - 0.7 * t).abs() <= 1.0 && (counts[1] - 0.3 * t).abs() <= 1.0);
    }
    // Asked for cold (a resumed run at step 500), a step's rows are those of the whole run.
    let cold = Blend::open(&[(0.7, web.clone()), (0.3, code.clone())]).unwrap();
    let (a, b) = (
        cold.batch(500, rows, block, seed).unwrap(),
        blend.batch(500, rows, block, seed).unwrap(),
    );
    assert_eq!(a.0.to_vec2::<u32>().unwrap(), b.0.to_vec2::<u32>().unwrap());
    assert_eq!(
        cold.assign(500 * rows as u64, rows),
        all[4000..4008].to_vec()
    );
    // The small dataset goes round many epochs, each window once an epoch.
    let code_data = blend.sources().nth(1).unwrap().1;
    let windows = code_data.windows(Split::Train, block);
    let taken = from(1) as u64;
    assert!(taken > 3 * windows, "{taken} rows of {windows} windows");
    for epoch in 0..3 {
        let mut seen: Vec<u64> = (epoch * windows..(epoch + 1) * windows)
            .map(|k| code_data.row_window(k, block, seed, 1).unwrap())
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..windows).collect::<Vec<_>>(), "epoch {epoch}");
    }
    // One dataset alone reads what it reads unblended.
    let one = Blend::open(&[(1.0, web.clone())]).unwrap();
    let ds = one.first();
    let want = ds.batch(7, rows, block, seed).unwrap();
    let got = one.batch(7, rows, block, seed).unwrap();
    assert_eq!(
        want.0.to_vec2::<u32>().unwrap(),
        got.0.to_vec2::<u32>().unwrap()
    );
    // Another tokenizer's shards are refused, and so are bad weights.
    let (other, _) = Tokenizer::train(
        &Corpus::new(vec![d.join("web.jsonl")]),
        280,
        &d.join("other.json"),
        InvalidUtf8::Error,
    )
    .unwrap();
    let theirs = dataset(&d, "theirs", &other, "book", 10);
    let e = Blend::open(&[(0.5, web.clone()), (0.5, theirs)])
        .err()
        .unwrap();
    assert!(e.to_string().contains("different tokenizers"), "{e}");
    let e = Blend::open(&[(0.0, web.clone()), (1.0, code.clone())])
        .err()
        .unwrap();
    assert!(e.to_string().contains("positive weight"), "{e}");
    // Weights whose sum overflows are shares all the same (they summed to infinity, and
    // every share was 0); one too small beside another to be read from is refused.
    let huge = Blend::open(&[(1e308, web.clone()), (1e308, code.clone())]).unwrap();
    let shares: Vec<f64> = huge.sources().map(|(w, _)| w).collect();
    assert_eq!(shares, [0.5, 0.5]);
    let e = Blend::open(&[(1e300, web), (1e-300, code)]).err().unwrap();
    assert!(
        e.to_string().contains("too small beside the largest"),
        "{e}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}
