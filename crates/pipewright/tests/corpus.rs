//! Corpora as users have them: bytes that are not UTF-8 (named by file and offset, or
//! replaced, or their documents skipped, and counted), a corpus of one line (split at the
//! held-out share all the same), and a tokenizer whose ids leave gaps (stored by its largest
//! id, not its count of entries). (One huge word under a memory limit: the CLI's size walk.)

use std::path::{Path, PathBuf};

use pipewright::data::Corpus;
use pipewright::data::{prepare, InvalidUtf8, PrepareOptions, TokenDtype, Tokenizer};
use pipewright::runtime::memory::CountingAlloc;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// One test at a time: the allocator's peak is the process's.
static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pw-corpus-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `n` bytes of words, `seed` choosing them.
fn words(n: usize, seed: u64, sep: &str) -> String {
    let vocab = [
        "pipe", "stage", "rank", "the", "of", "grad", "loss", "step", "x", "ring",
    ];
    let (mut s, mut x) = (String::new(), seed.wrapping_mul(2654435761) | 1);
    while s.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(vocab[(x % vocab.len() as u64) as usize]);
        s.push_str(sep);
    }
    s.truncate(n);
    s
}

fn opts(invalid: InvalidUtf8) -> PrepareOptions {
    PrepareOptions {
        shard_tokens: 1 << 12,
        held_out: 0.1,
        chunk_bytes: 1 << 12,
        dtype: None,
        invalid_utf8: invalid,
        ..Default::default()
    }
}

#[test]
fn bytes_that_are_not_utf8_are_named_replaced_or_skipped() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let d = tmp("utf8");
    let (good, bad) = (d.join("a.txt"), d.join("b.bin"));
    std::fs::write(&good, words(20_000, 1, " ")).unwrap();
    let mut b = words(9_000, 2, " ").into_bytes();
    b[5000] = 0xff;
    std::fs::write(&bad, &b).unwrap();
    let files = [good.clone(), bad.clone()];
    let e = Tokenizer::train(
        &Corpus::new(files.to_vec()),
        300,
        &d.join("t0.json"),
        InvalidUtf8::Error,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("b.bin") && e.contains("byte 5000"), "{e}");
    assert!(e.contains("--invalid-utf8 replace"), "{e}");
    assert!(!d.join("t0.json").exists(), "nothing written");
    let (_, replaced) = Tokenizer::train(
        &Corpus::new(files.to_vec()),
        300,
        &d.join("t1.json"),
        InvalidUtf8::Replace,
    )
    .unwrap();
    assert_eq!(replaced.replaced_bytes, 1);
    let (tok, skipped) = Tokenizer::train(
        &Corpus::new(files.to_vec()),
        300,
        &d.join("t2.json"),
        InvalidUtf8::Skip,
    )
    .unwrap();
    assert_eq!(
        (skipped.skipped_documents, skipped.skipped_bytes),
        (1, 9_000)
    );
    // data prepare reads by the same rule.
    let e = prepare(
        &tok,
        &Corpus::new(files.to_vec()),
        &d.join("s0"),
        &opts(InvalidUtf8::Error),
        &mut |_, _, _| {},
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("b.bin") && e.contains("byte 5000"), "{e}");
    let index = prepare(
        &tok,
        &Corpus::new(files.to_vec()),
        &d.join("s1"),
        &opts(InvalidUtf8::Replace),
        &mut |_, _, _| {},
    )
    .unwrap();
    assert_eq!((index.replaced_bytes, index.documents), (1, 2));
    let index = prepare(
        &tok,
        &Corpus::new(files.to_vec()),
        &d.join("s2"),
        &opts(InvalidUtf8::Skip),
        &mut |_, _, _| {},
    )
    .unwrap();
    assert_eq!((index.skipped_documents, index.documents), (1, 1));
}

/// Tokens of a split's shards.
fn tokens(s: &[pipewright::data::shards::ShardFile]) -> u64 {
    s.iter().map(|f| f.tokens).sum()
}

#[test]
fn a_corpus_of_one_line_is_split_at_the_held_out_share() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let d = tmp("one-line");
    let corpus = d.join("line.txt");
    std::fs::write(&corpus, words(200_000, 3, " ")).unwrap();
    let files = [corpus];
    let (tok, _) = Tokenizer::train(
        &Corpus::new(files.to_vec()),
        400,
        &d.join("t.json"),
        InvalidUtf8::Error,
    )
    .unwrap();
    let index = prepare(
        &tok,
        &Corpus::new(files.to_vec()),
        &d.join("s"),
        &opts(InvalidUtf8::Error),
        &mut |_, _, _| {},
    )
    .unwrap();
    let (train, valid) = (tokens(&index.train), tokens(&index.valid));
    let share = valid as f64 / (train + valid) as f64;
    assert!(
        (0.08..0.12).contains(&share),
        "{train} and {valid} tokens: {share}"
    );
}

/// A WordLevel tokenizer whose ids are 0, 1, 2 and 70,000 (four entries).
fn sparse_tokenizer(path: &Path) -> Tokenizer {
    let vocab: std::collections::HashMap<String, u32> =
        [("a", 0), ("b", 1), ("<unk>", 2), ("<|endoftext|>", 70_000)]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
    let model = tokenizers::models::wordlevel::WordLevel::builder()
        .vocab(vocab.into_iter().collect())
        .unk_token("<unk>".into())
        .build()
        .unwrap();
    let mut t = tokenizers::Tokenizer::new(model);
    t.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::Whitespace {}));
    t.save(path, false).unwrap();
    Tokenizer::load(path).unwrap()
}

#[test]
fn ids_are_stored_by_the_largest_id() {
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let d = tmp("sparse");
    let tok = sparse_tokenizer(&d.join("t.json"));
    assert_eq!(tok.vocab_size(), 70_001, "one more than the largest id");
    let corpus = d.join("c.txt");
    std::fs::write(&corpus, "a b a b\n".repeat(200)).unwrap();
    let index = prepare(
        &tok,
        &Corpus::new(vec![corpus]),
        &d.join("s"),
        &opts(InvalidUtf8::Error),
        &mut |_, _, _| {},
    )
    .unwrap();
    assert_eq!(index.dtype, TokenDtype::U32);
    let last = std::fs::read(d.join("s").join(&index.valid[0].file)).unwrap();
    let ids: Vec<u32> = last
        .chunks(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(*ids.last().unwrap(), 70_000, "the document's end, whole");
}
