//! A user's corpus: a byte-level BPE trained here encodes and decodes back exactly (and as the
//! Python `tokenizers` package does, on a committed fixture); shards stream a corpus larger
//! than the memory they are made with and decode back to it; an epoch gives every window once,
//! each replica its own rows, and a resumed run the same next rows; bad shard directories and
//! corpora are clear errors that leave nothing behind.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use pipewright::data::Corpus;
use pipewright::data::{
    prepare, InvalidUtf8, PrepareOptions, Split, TokenDataset, TokenDtype, Tokenizer,
};
use pipewright::parallel::data_parallel::ReplicaBatches;
use pipewright::runtime::memory::{live_bytes, peak_bytes, reset_peaks, CountingAlloc};
use pipewright::Batch;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// One test at a time: the allocator's peak is the process's.
static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one() -> std::sync::MutexGuard<'static, ()> {
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pw-data-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// This crate's own sources: a corpus every checkout has.
fn sources() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/parallel/pipeline");
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect();
    v.sort();
    v
}

fn tokenizer(dir: &Path) -> Tokenizer {
    std::fs::create_dir_all(dir).unwrap();
    Tokenizer::train(
        &Corpus::new(sources().to_vec()),
        600,
        &dir.join("tok.json"),
        InvalidUtf8::Error,
    )
    .unwrap()
    .0
}

fn small() -> PrepareOptions {
    PrepareOptions {
        shard_tokens: 4096,
        held_out: 0.1,
        chunk_bytes: 4096,
        dtype: None,
        invalid_utf8: InvalidUtf8::Error,
        ..Default::default()
    }
}

#[test]
fn bpe_round_trip_and_python_parity() {
    let _one = one();
    let dir = tmp("bpe");
    let tok = tokenizer(&dir);
    assert_eq!(tok.vocab_size(), 600);
    for text in [
        "fn main() {}\n",
        "  indented\n\tand tabs",
        "ünïcödé ✓ 日本語",
        "",
    ] {
        let ids = tok.encode(text).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text);
    }
    // Merges were learnt: the corpus takes fewer ids than bytes.
    let text = std::fs::read_to_string(&sources()[0]).unwrap();
    assert!(tok.encode(&text).unwrap().len() < text.len() / 2);
    // The Python package's ids on the committed fixture (tools/make_tokenizer_fixture.py).
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer");
    let tok = Tokenizer::load(&fx.join("tokenizer.json")).unwrap();
    let cases: Vec<(String, Vec<u32>)> =
        serde_json::from_str(&std::fs::read_to_string(fx.join("ids.json")).unwrap()).unwrap();
    assert!(cases.len() >= 5);
    for (text, want) in cases {
        assert_eq!(tok.encode(&text).unwrap(), want, "{text:?}");
        assert_eq!(tok.decode(&want).unwrap(), text);
    }
}

/// Every id of `split`, in order.
fn all_ids(ds: &TokenDataset, split: Split) -> Vec<u32> {
    let n = ds.tokens(split) as usize;
    let w = ds.window(split, 0, n - 1).unwrap();
    assert_eq!(w.len(), n);
    w
}

#[test]
fn shards_stream_a_corpus_larger_than_their_memory_and_decode_back() {
    let _one = one();
    let dir = tmp("stream");
    let tok = tokenizer(&dir);
    // A corpus of `copies` copies of each source file per document, 24 documents; the bytes
    // prepare held at once beyond what was live before.
    let make = |name: &str, copies: usize| {
        let mut files = Vec::new();
        let mut text = Vec::new();
        for (i, src) in sources().iter().cycle().take(24).enumerate() {
            let body = std::fs::read_to_string(src).unwrap().repeat(copies);
            let f = dir.join(format!("{name}-{i:02}.txt"));
            std::fs::write(&f, &body).unwrap();
            files.push(f);
            text.push(body);
        }
        let out = dir.join(name);
        let before = live_bytes().unwrap();
        reset_peaks();
        let index = prepare(
            &tok,
            &Corpus::new(files.to_vec()),
            &out,
            &small(),
            &mut |_, _, _| {},
        )
        .unwrap();
        let held = peak_bytes().unwrap() - before;
        (text, out, index, held)
    };
    let (_, _, _, held_small) = make("small", 4);
    // Large enough that the encoder's own fixed bytes (its word cache, the workers' pool:
    // about 2.6 MB, whatever the corpus) are well under half of it.
    let (text, out, index, held) = make("large", 64);
    let corpus: usize = text.iter().map(String::len).sum();
    assert!(corpus > 4 << 20, "{corpus}");
    // What it holds does not grow with the corpus (16 times larger here).
    assert!(
        held < corpus as u64 / 2 && held < held_small + (1 << 20),
        "prepare held {held} bytes at once for a corpus of {corpus} ({held_small} for a \
         sixteenth of it)"
    );
    assert!(index.train.len() > 10 && !index.valid.is_empty());
    assert_eq!(index.dtype, TokenDtype::U16);
    assert_eq!(index.documents, 24);
    // Both splits decode back to the corpus, documents ended by <|endoftext|>.
    let ds = TokenDataset::open(&out, Some(&tok)).unwrap();
    let mut ids = all_ids(&ds, Split::Train);
    ids.extend(all_ids(&ds, Split::Valid));
    let decoded = tok.decode(&ids).unwrap();
    let want: String = text.iter().map(|t| format!("{t}<|endoftext|>")).collect();
    assert_eq!(decoded, want);
    // Held out: about the last tenth of the bytes.
    let share = ds.tokens(Split::Valid) as f64 / ids.len() as f64;
    assert!((0.05..0.2).contains(&share), "{share}");
}

#[test]
fn an_epoch_gives_every_window_once_and_replicas_their_own_rows() {
    let _one = one();
    let dir = tmp("epoch");
    let tok = tokenizer(&dir);
    let out = dir.join("shards");
    prepare(
        &tok,
        &Corpus::new(sources().to_vec()),
        &out,
        &small(),
        &mut |_, _, _| {},
    )
    .unwrap();
    let ds = TokenDataset::open(&out, None).unwrap();
    let (block, rows, seed) = (16, 8, 7);
    let n = ds.windows(Split::Train, block);
    assert!(n > 100, "{n}");
    // One epoch: every window exactly once; the next epoch in another order.
    let steps = n / rows as u64;
    let mut seen = Vec::new();
    for s in 0..steps {
        seen.extend(ds.rows(s, rows, block, seed).unwrap());
    }
    let distinct: HashSet<u64> = seen.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        seen.len(),
        "a window came twice in one epoch"
    );
    assert_eq!(seen.len() as u64, steps * rows as u64);
    let first: Vec<u64> = (0..n)
        .map(|g| ds.rows(g, 1, block, seed).unwrap()[0])
        .collect();
    let second: Vec<u64> = (n..2 * n)
        .map(|g| ds.rows(g, 1, block, seed).unwrap()[0])
        .collect();
    assert_eq!(
        first.iter().copied().collect::<HashSet<_>>(),
        (0..n).collect::<HashSet<_>>()
    );
    assert_ne!(first, second, "each epoch is shuffled anew");
    // Two replicas: their rows of a step are disjoint and together the global batch.
    let f = |step: u64, r: usize| {
        ds.batch(step, r, block, seed)
            .map(|(x, y)| Batch::pair(x, y))
    };
    let cpu = candle_core::Device::Cpu;
    let a = ReplicaBatches::new(f, rows, 0, 2, cpu.clone()).unwrap();
    let b = ReplicaBatches::new(f, rows, 1, 2, cpu).unwrap();
    let whole = f(3, rows).unwrap();
    let (xa, xb) = (a.batch(3).unwrap(), b.batch(3).unwrap());
    let joined = candle_core::Tensor::cat(
        &[
            xa.get(Batch::INPUTS).unwrap(),
            xb.get(Batch::INPUTS).unwrap(),
        ],
        0,
    )
    .unwrap();
    let whole_x = whole.get(Batch::INPUTS).unwrap();
    assert_eq!(
        joined.to_vec2::<u32>().unwrap(),
        whole_x.to_vec2::<u32>().unwrap()
    );
    // A resumed run (a fresh dataset) reads the same rows at step 5 as one that went on.
    let again = TokenDataset::open(&out, None).unwrap();
    let (x1, y1) = ds.batch(5, rows, block, seed).unwrap();
    let (x2, y2) = again.batch(5, rows, block, seed).unwrap();
    assert_eq!(x1.to_vec2::<u32>().unwrap(), x2.to_vec2::<u32>().unwrap());
    assert_eq!(y1.to_vec2::<i64>().unwrap(), y2.to_vec2::<i64>().unwrap());
    // Targets are inputs shifted by one.
    let (x, y) = (x1.to_vec2::<u32>().unwrap(), y1.to_vec2::<i64>().unwrap());
    assert_eq!(
        x[0][1..],
        y[0][..block - 1]
            .iter()
            .map(|&v| v as u32)
            .collect::<Vec<_>>()[..]
    );
}

#[test]
fn bad_shards_and_corpora_are_clear_errors() {
    let _one = one();
    let dir = tmp("bad");
    let tok = tokenizer(&dir);
    let out = dir.join("shards");
    prepare(
        &tok,
        &Corpus::new(sources().to_vec()),
        &out,
        &small(),
        &mut |_, _, _| {},
    )
    .unwrap();
    // Another tokenizer.
    let other_dir = dir.join("other");
    std::fs::create_dir_all(&other_dir).unwrap();
    let other = Tokenizer::train(
        &Corpus::new(sources()[..1].to_vec()),
        300,
        &other_dir.join("tok.json"),
        InvalidUtf8::Error,
    )
    .unwrap()
    .0;
    let e = TokenDataset::open(&out, Some(&other))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("encoded by another tokenizer"), "{e}");
    // A truncated shard.
    let shard = out.join("train-00001.bin");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 3]).unwrap();
    let e = TokenDataset::open(&out, None).err().unwrap().to_string();
    assert!(e.contains("truncated or damaged"), "{e}");
    // An empty corpus; into an existing directory; nothing is left behind.
    let empty = dir.join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let none = dir.join("none");
    let e = prepare(
        &tok,
        &Corpus::new([empty].to_vec()),
        &none,
        &small(),
        &mut |_, _, _| {},
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("corpus is empty"), "{e}");
    let e = prepare(
        &tok,
        &Corpus::new(sources().to_vec()),
        &out,
        &small(),
        &mut |_, _, _| {},
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("already exists"), "{e}");
    // A vocabulary u16 ids cannot hold.
    let big = dir.join("big.json");
    let vocab: std::collections::HashMap<String, u32> =
        (0..70_000u32).map(|i| (format!("w{i}"), i)).collect();
    let model = tokenizers::models::wordlevel::WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token("w0".into())
        .build()
        .unwrap();
    let mut t = tokenizers::Tokenizer::new(model);
    let _ = t.add_special_tokens([tokenizers::AddedToken::from("<|endoftext|>", true)]);
    t.save(&big, false).unwrap();
    let big = Tokenizer::load(&big).unwrap();
    let u16s = PrepareOptions {
        dtype: Some(TokenDtype::U16),
        ..small()
    };
    let e = prepare(
        &big,
        &Corpus::new(sources().to_vec()),
        &none,
        &u16s,
        &mut |_, _, _| {},
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("does not fit in u16"), "{e}");
    assert!(!none.exists());
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}
