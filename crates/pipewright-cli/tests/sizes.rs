//! Every flag that sets a size or a count, given 10^6, 10^9, 2^63 and its largest value under
//! an address-space limit of 4 GiB (`ulimit -v`), ends with a clear error or works: never an
//! allocation abort (134), a kill (137), a segfault (139) or a panic (101). A command still
//! running after a few seconds, within the limit, is working (a long benchmark, a long
//! generation streaming its tokens).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{text, tmp, train, TINY};

const VALUES: [&str; 4] = [
    "1000000",
    "1000000000",
    "9223372036854775808",
    "18446744073709551615",
];

/// How a bounded run ended: its exit code and output, or `None` when it was still running.
fn bounded(dir: &Path, args: &[String]) -> Option<(Option<i32>, String)> {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg("ulimit -v 4194304 && exec \"$0\" \"$@\"")
        .arg(env!("CARGO_BIN_EXE_pipewright"))
        .args(args)
        .current_dir(dir)
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(5) {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let o = child.wait_with_output().unwrap();
    Some((o.status.code(), text(&o)))
}

/// The cases: a label and the arguments, `@` standing for the value.
fn cases() -> Vec<(String, Vec<String>)> {
    let tiny = "--n-layer 1 --n-head 2 --n-embd 16 --batch-size 8 --steps 1";
    let mut out: Vec<(String, String)> = Vec::new();
    let train_flags = [
        "n-layer",
        "n-head",
        "n-embd",
        "block-size",
        "vocab-size",
        "batch-size",
        "chunks",
        "chunk-size",
        "pp",
        "tp",
        "dp",
        "cp",
        "virtual-stages",
        "digits",
        "keep",
        "log-every",
        "eval-every",
    ];
    for f in train_flags {
        out.push((
            format!("train --{f}"),
            format!("train {tiny} --{f} @ --out o"),
        ));
    }
    for f in ["mlp-hidden", "n-kv-head"] {
        let a = format!("train --model llama {tiny} --{f} @ --out o");
        out.push((format!("train llama --{f}"), a));
    }
    for f in ["width", "blocks", "image-size"] {
        let a = format!("train --model cnn --task shapes --steps 1 --batch-size 8 --{f} @ --out o");
        out.push((format!("train cnn --{f}"), a));
    }
    let prof = "profile --n-layer 1 --n-head 2 --n-embd 16";
    let gen = "generate --checkpoint base/checkpoints --prompt-ids 1,2";
    for (label, a) in [
        (
            "data tokenizer --vocab-size",
            "data tokenizer --vocab-size @ --out o.json corpus.txt",
        ),
        (
            "data prepare --shard-tokens",
            "data prepare --tokenizer tok.json --shard-tokens @ --out o corpus.txt",
        ),
        ("profile --sizes", &format!("{prof} --sizes @ --out o.json")),
        (
            "profile --tp-sizes",
            &format!("{prof} --tp-sizes @ --out o.json"),
        ),
        (
            "profile --concurrent",
            &format!("{prof} --concurrent @ --out o.json"),
        ),
        (
            "profile --gemm-scale",
            "profile --gemm --gemm-scale @ --out o.json",
        ),
        ("bench comm --sizes", "bench comm --sizes @"),
        ("bench comm --world", "bench comm --world @"),
        ("bench comm --iters", "bench comm --iters @"),
        ("bench ckpt --n-layer", "bench ckpt --n-layer @ --dir ."),
        (
            "generate --max-new-tokens",
            &format!("{gen} --max-new-tokens @"),
        ),
        ("generate --top-k", &format!("{gen} --top-k @")),
        ("generate --pp", &format!("{gen} --pp @")),
        ("generate --tp", &format!("{gen} --tp @")),
        (
            "launch --nproc-per-node",
            "launch --nproc-per-node @ -- /bin/true",
        ),
        (
            "balance --partitions",
            "balance --costs 1,2,3 --partitions @",
        ),
        ("plan --world", "plan --world @"),
        ("schedule --pp", "schedule --pp @ --chunks 4"),
        ("schedule --chunks", "schedule --pp 2 --chunks @"),
        ("schedule --mbs", "schedule --pp 2 --chunks 4 --mbs @"),
        (
            "sweep --max-parallel",
            "sweep --max-parallel @ --param lr=1e-3 --out o -- /bin/true",
        ),
    ] {
        out.push((label.to_string(), a.to_string()));
    }
    out.into_iter()
        .map(|(l, a)| (l, a.split_whitespace().map(String::from).collect()))
        .collect()
}

#[test]
fn every_size_flag_ends_in_a_clear_error_or_works_under_a_memory_limit() {
    let dir = tmp("sizes");
    std::fs::create_dir_all(&dir).unwrap();
    let base = dir.join("base");
    let mut a: Vec<&str> = TINY.to_vec();
    a.extend_from_slice(&["--steps", "1", "--checkpoint-every", "1", "--out"]);
    a.push(base.to_str().unwrap());
    assert!(train(&a).status.success());
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md"));
    std::fs::write(dir.join("corpus.txt"), &readme.unwrap()[..20_000]).unwrap();
    let tok = bounded(
        &dir,
        &[
            "data",
            "tokenizer",
            "--vocab-size",
            "300",
            "--out",
            "tok.json",
            "corpus.txt",
        ]
        .map(String::from),
    );
    assert!(matches!(tok, Some((Some(0), _))), "{tok:?}");
    let mut bad = Vec::new();
    let mut n = 0;
    for (label, args) in cases() {
        for v in VALUES {
            let args: Vec<String> = args.iter().map(|a| a.replace('@', v)).collect();
            let ended = bounded(&dir, &args);
            let _ = std::fs::remove_dir_all(dir.join("o"));
            let _ = std::fs::remove_file(dir.join("o.json"));
            n += 1;
            match &ended {
                None => {}
                Some((Some(0..=2), out)) if !out.contains("panicked") => {}
                Some((code, out)) => {
                    let last = out
                        .lines()
                        .rev()
                        .find(|l| !l.trim().is_empty())
                        .unwrap_or("");
                    bad.push(format!("{label} {v}: exit {code:?}: {last}"));
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "{} of {n} cases crashed:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn a_corpus_of_one_huge_word_is_refused_not_aborted() {
    let dir = tmp("huge-word");
    std::fs::create_dir_all(&dir).unwrap();
    // 64 MiB of letters without a space: every piece a word of its own, 80 bytes a byte to
    // train on (5 GB), over the limit.
    let mut x: u64 = 1;
    let word: Vec<u8> = (0..64 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            b'a' + (x % 26) as u8
        })
        .collect();
    std::fs::write(dir.join("word.txt"), word).unwrap();
    let args = [
        "data",
        "tokenizer",
        "--vocab-size",
        "1000",
        "--out",
        "t.json",
        "word.txt",
    ];
    let ended = bounded(&dir, &args.map(String::from));
    let Some((Some(1), out)) = &ended else {
        panic!("{ended:?}");
    };
    assert!(
        out.contains("distinct words") && out.contains("sample"),
        "{out}"
    );
    assert!(!dir.join("t.json").exists());
}

#[test]
fn a_balance_too_large_to_search_is_refused_at_once() {
    let dir = tmp("big-balance");
    std::fs::create_dir_all(&dir).unwrap();
    let costs = vec!["1"; 30_000].join(",");
    let args = ["balance", "--costs", &costs, "--partitions", "1000"].map(String::from);
    let t = Instant::now();
    let ended = bounded(&dir, &args);
    let Some((Some(1), out)) = &ended else {
        panic!("{ended:?}");
    };
    assert!(out.contains("fewer partitions"), "{out}");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "it ran past five minutes before"
    );
}
