//! Fuzzing the readers of what users and other programs hand pipewright: a checkpoint's
//! manifest, its state.json and its safetensors files, a parameters file, a hardware file.
//! Each input is a real one mutated (bytes flipped, cut, repeated, or spliced with hostile
//! tokens: `../`, absolute paths, huge and negative numbers). Every read must return (an
//! error is fine) without a panic, hold no more memory than the input justifies (counted by
//! the allocator), and never accept a manifest that names a file outside its directory.
//!
//! `PIPEWRIGHT_FUZZ_CASES` sets the cases per reader (default 64 in the test suite; CI runs
//! 50,000 each, about 80 s for all five here). Taking out the manifest's file-name check makes
//! `manifests` fail within a few thousand cases.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::checkpoint::{self, Manifest, Reader};
use pipewright::engine::varuna::{TrainState, Varuna, VarunaOptions};
use pipewright::experiment::params::{parse, standard};
use pipewright::plan::Hardware;
use pipewright::runtime::memory::{live_bytes, peak_bytes, reset_peaks, CountingAlloc};
use pipewright_models::{gpt, GptConfig, TIED};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// One reader at a time: the allocator's peak is the process's.
static SERIAL: Mutex<()> = Mutex::new(());

const TOKENS: &[&str] = &[
    "../",
    "/etc/passwd",
    "..",
    "/",
    "1e308",
    "-1",
    "18446744073709551615",
    "null",
    "[]",
    "{}",
    "\"",
    ",",
    "NaN",
    "99999999999999999999",
    "step-00000002",
    "\u{0}",
];

/// An edit of an input: where (a fraction of its length), what, and with which byte or token.
type Edit = (u32, u8, u8, usize);

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    prop::collection::vec((any::<u32>(), 0u8..5, any::<u8>(), 0..TOKENS.len()), 1..6)
}

fn mutate(input: &[u8], edits: &[Edit]) -> Vec<u8> {
    let mut v = input.to_vec();
    for &(at, op, byte, token) in edits {
        let i = if v.is_empty() {
            0
        } else {
            at as usize % v.len()
        };
        match op {
            0 if !v.is_empty() => v[i] = byte,
            1 => v.truncate(i),
            2 => {
                let end = (i + 1 + byte as usize % 16).min(v.len());
                v.drain(i..end);
            }
            3 => {
                let t = TOKENS[token].as_bytes();
                v.splice(i..i, t.iter().copied());
            }
            _ => {
                let end = (i + byte as usize % 64).min(v.len());
                let copy = v[i..end].to_vec();
                v.splice(i..i, copy);
            }
        }
    }
    v
}

/// Runs `read` on an input of `len` bytes: it must not panic, and the most it holds at once
/// must stay under 32 MiB plus 64 bytes per input byte.
fn bounded(len: usize, read: impl FnOnce()) {
    let before = live_bytes().expect("the counting allocator is installed");
    reset_peaks();
    read();
    let grew = peak_bytes().unwrap_or(0).saturating_sub(before);
    assert!(
        grew < (32 << 20) + 64 * len as u64,
        "{grew} bytes held for an input of {len}"
    );
}

fn cases() -> u32 {
    std::env::var("PIPEWRIGHT_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(64)
}

fn fuzz(input: &[u8], check: impl Fn(&[u8])) {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let mut runner = TestRunner::new(Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&edits(), |e| {
            let bytes = mutate(input, &e);
            bounded(bytes.len(), || check(&bytes));
            Ok(())
        })
        .unwrap();
}

/// A checkpoint of a small GPT saved at tp=2 (its tensors split in parts over two files).
fn checkpoint() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = std::env::temp_dir().join(format!("pw-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let cfg = GptConfig {
            vocab_size: 10,
            block_size: 6,
            n_layer: 1,
            n_head: 2,
            n_embd: 8,
            dropout: 0.0,
        };
        let opts = VarunaOptions {
            shared_weights: vec![(TIED.0.into(), TIED.1.into())],
            ..VarunaOptions::new(Layout::new(1, 2, 1).unwrap(), 2, 2)
        };
        let dirs = local::run(2, |comm| {
            let mut v = Varuna::new(&gpt(cfg)?, Box::new(comm), opts.clone())?;
            v.set_optimizer(|ps| {
                pipewright::model::nn::optim::OptimizerConfig::default().build(ps, &[])
            })?;
            v.checkpoint(&root, &Default::default())
        })
        .unwrap();
        dirs[0].clone()
    })
}

/// A copy of the checkpoint with `name` replaced by `bytes`.
fn with_file(name: &str, bytes: &[u8]) -> PathBuf {
    let src = checkpoint();
    let dst = src.with_file_name(format!("case-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(src).unwrap().flatten() {
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    std::fs::write(dst.join(name), bytes).unwrap();
    dst
}

/// Reads everything of the checkpoint in `dir` that a resumed run or `ckpt` reads.
fn read_all(dir: &Path) {
    let _ = checkpoint::verify(dir);
    if let Ok(r) = Reader::open(dir) {
        for name in r.manifest().tensors.keys() {
            let _ = r.read_whole(name);
        }
        let _ = serde_json::from_value::<TrainState>(r.state().clone());
    }
}

#[test]
fn manifests() {
    let good = std::fs::read(checkpoint().join("manifest.json")).unwrap();
    fuzz(&good, |bytes| {
        let dir = with_file("manifest.json", bytes);
        if let Ok(m) = Manifest::read(&dir) {
            // Accepted: every file it names is a plain name of its directory.
            for p in m.tensors.values().flat_map(|e| &e.parts) {
                assert!(
                    !p.file.contains('/') && p.file != ".." && p.file != ".",
                    "{}",
                    p.file
                );
            }
        }
        read_all(&dir);
    });
}

#[test]
fn states() {
    let good = std::fs::read(checkpoint().join("state.json")).unwrap();
    fuzz(&good, |bytes| {
        // With its checksum mended, so that the mutated state is parsed, not refused at once.
        let dir = with_file("state.json", bytes);
        let mp = dir.join("manifest.json");
        let mut m: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&mp).unwrap()).unwrap();
        m["files"]["state.json"] = pipewright::runtime::digest::sha256(bytes).into();
        std::fs::write(&mp, m.to_string()).unwrap();
        read_all(&dir);
    });
}

#[test]
fn safetensors_files() {
    let file = std::fs::read_dir(checkpoint())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .find(|n| n.ends_with(".safetensors"))
        .unwrap();
    let good = std::fs::read(checkpoint().join(&file)).unwrap();
    fuzz(&good, |bytes| {
        let dir = with_file(&file, bytes);
        let _ = checkpoint::format::file_sha256(&dir.join(&file));
        read_all(&dir);
    });
}

#[test]
fn parameter_files() {
    let good = serde_json::json!({"random_seed": 3, "output_dir": "./out", "debug": false,
        "nproc_per_node": 1, "master_port": 29500});
    let good = serde_json::to_vec_pretty(&good).unwrap();
    let path = std::env::temp_dir().join(format!("pw-fuzz-params-{}.json", std::process::id()));
    fuzz(&good, |bytes| {
        std::fs::write(&path, bytes).unwrap();
        let args = ["fuzz", "--params-file", path.to_str().unwrap()];
        let _ = parse("fuzz", "", &standard(), None, args);
    });
}

#[test]
fn hardware_files() {
    let good = serde_json::to_vec_pretty(&Hardware::load("h100-node").unwrap()).unwrap();
    fuzz(&good, |bytes| {
        if let Ok(hw) = Hardware::parse(&String::from_utf8_lossy(bytes), "fuzz") {
            // Accepted: sizes a planner can divide by.
            assert!(hw.memory_bytes() > 0);
        }
    });
}
