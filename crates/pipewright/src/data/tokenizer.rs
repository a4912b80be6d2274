//! Tokenizers in Hugging Face's `tokenizer.json` format, through its own Rust crate: train a
//! byte-level BPE on a corpus (GPT-2's kind: every byte is a token, so any text encodes and
//! decodes back exactly), or load any `tokenizer.json` a user brings. Nothing is downloaded.

use std::path::{Path, PathBuf};

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, TokenizerBuilder};

use super::corpus::{Cleaned, InvalidUtf8, Pieces};
use super::documents::Corpus;
use crate::{invalid, Error, Result};

/// The token that ends every document of a prepared corpus (GPT-2's).
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// A loaded tokenizer and the checksum of its file (what token shards record, so that shards
/// are never read with another tokenizer).
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    sha256: String,
    path: PathBuf,
    /// One more than the largest id (ids may leave gaps: a count of entries is less).
    ids: usize,
}

fn tok_err<'a>(what: &'a str, path: &'a Path) -> impl Fn(tokenizers::Error) -> Error + 'a {
    let what = what.to_string();
    move |e| invalid!("{what} `{}`: {e}", path.display())
}

/// Bytes of the pieces the trainer is fed.
const PIECE: usize = 1 << 16;

/// Bytes the BPE trainer holds per byte of the corpus's distinct words (each byte a symbol of
/// 32 bytes, its pairs' counts and positions besides; 612 MiB for 8 MiB of one word).
const TRAINER_BYTES_PER_BYTE: f64 = 80.0;

/// The distinct words fed to the trainer so far (split at whitespace, as its pre-tokenizer
/// nearly does), to refuse a corpus whose training would not fit in memory before the trainer
/// allocates for it: text with few repeated words (a long run without spaces, random bytes)
/// costs the trainer [`TRAINER_BYTES_PER_BYTE`] per byte.
struct DistinctWords {
    seen: std::collections::HashSet<u64>,
    bytes: u64,
    budget: Option<f64>,
}

impl DistinctWords {
    fn new(vocab_size: usize) -> Self {
        let budget = crate::runtime::memory::available_bytes()
            .map(|a| a as f64 * 0.8 - vocab_size as f64 * 100.0);
        Self {
            seen: Default::default(),
            bytes: 0,
            budget,
        }
    }

    /// Counts `text`'s new words; an error once training on them would not fit.
    fn add(&mut self, text: &str) -> Result<()> {
        for w in text.split_whitespace() {
            if self
                .seen
                .insert(crate::runtime::seed::hash_seed(&[w.as_bytes()]))
            {
                self.bytes += w.len() as u64;
            }
        }
        let need = self.bytes as f64 * TRAINER_BYTES_PER_BYTE;
        match self.budget {
            Some(b) if need > b => Err(invalid!(
                "the corpus's distinct words already total {} and training a tokenizer on them \
                 takes about {}, more than this machine has available: train it on a sample of \
                 the corpus (text with repeated words, not one long run without spaces)",
                crate::runtime::bytes::format_bytes(self.bytes as f64),
                crate::runtime::bytes::format_bytes(need)
            )),
            _ => Ok(()),
        }
    }
}

impl Tokenizer {
    /// Loads the `tokenizer.json` at `path`.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io("cannot read tokenizer", path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(tok_err(
            "not a tokenizer.json (Hugging Face's format)",
            path,
        ))?;
        let ids = inner
            .get_vocab(true)
            .into_values()
            .max()
            .map_or(0, |m| m as usize + 1);
        Ok(Self {
            inner,
            sha256: crate::runtime::digest::sha256(&bytes),
            path: path.to_path_buf(),
            ids,
        })
    }

    /// Trains a byte-level BPE of `vocab_size` tokens (the 256 bytes, [`END_OF_TEXT`] and the
    /// merges) on the documents of `files` ([`super::documents`]), and writes it to `out` as `tokenizer.json`. The
    /// files stream in bounded pieces ([`super::corpus`]: a corpus of one long line or one
    /// long word trains in the memory of any other), `policy` says what to do with bytes that
    /// are not UTF-8; returns what it replaced or skipped.
    pub fn train(
        files: &Corpus,
        vocab_size: usize,
        out: &Path,
        policy: InvalidUtf8,
    ) -> Result<(Self, Cleaned)> {
        if files.files.is_empty() {
            return Err(invalid!(
                "no files to train a tokenizer on: name at least one"
            ));
        }
        if vocab_size < 257 {
            return Err(invalid!(
                "a byte-level BPE needs a vocabulary of at least 257 (the 256 bytes and {END_OF_TEXT}), got {vocab_size}"
            ));
        }
        let bytes = super::corpus_bytes(files)?;
        // Each merge joins two symbols of the corpus into one: no more merges than bytes.
        let most = 257u64.saturating_add(bytes);
        if vocab_size as u64 > most {
            return Err(invalid!(
                "a vocabulary of {vocab_size} cannot be learnt from {bytes} bytes of text (at \
                 most {most} tokens: the 256 bytes, {END_OF_TEXT} and one merge per byte): \
                 give a smaller --vocab-size or more text"
            ));
        }
        // The trainer's tables take about 100 bytes a token, besides the corpus's words.
        crate::runtime::memory::check_fits(
            vocab_size as f64 * 100.0,
            &format!("a tokenizer of {vocab_size} tokens"),
            "give a smaller --vocab-size",
        )?;
        crate::runtime::files::ensure_new(out, "--out")?;
        let mut trainer = BpeTrainerBuilder::new()
            .show_progress(false)
            .vocab_size(vocab_size)
            .min_frequency(0)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .special_tokens(vec![AddedToken::from(END_OF_TEXT.to_string(), true)])
            .build();
        // No prefix space and no normalizer: decoding gives back exactly the text.
        let byte_level = ByteLevel::new(false, true, true);
        let mut tok = TokenizerBuilder::new()
            .with_model(BPE::default())
            .with_normalizer(None::<tokenizers::NormalizerWrapper>)
            .with_pre_tokenizer(Some(byte_level))
            .with_post_processor(Some(byte_level))
            .with_decoder(Some(byte_level))
            .build()
            .map_err(|e| invalid!("cannot build a tokenizer: {e}"))?;
        // A first pass counts the distinct words (and meets any text that is not UTF-8) before
        // the trainer allocates for them: a corpus it could not hold is refused, not aborted.
        let mut words = DistinctWords::new(vocab_size);
        for p in Pieces::new(files, policy, PIECE) {
            words.add(&p?.text)?;
        }
        // Pieces of 64 KiB: the trainer counts each piece's words, and a word is never longer.
        let mut pieces = Pieces::new(files, policy, PIECE);
        let failed = std::sync::Mutex::new(None);
        let texts = std::iter::from_fn(|| match pieces.next()? {
            Ok(p) => Some(p.text),
            Err(e) => {
                *failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                None
            }
        });
        let trained = tok.train(&mut trainer, texts).map(|_| ());
        if let Some(e) = failed.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return Err(e);
        }
        trained.map_err(|e| invalid!("training the tokenizer failed: {e}"))?;
        let cleaned = pieces.cleaned;
        let tmp = out.with_extension("json.tmp");
        tokenizers::Tokenizer::from(tok)
            .save(&tmp, true)
            .map_err(tok_err("cannot write", &tmp))?;
        std::fs::rename(&tmp, out).map_err(|e| Error::io("cannot rename into", out, e))?;
        Ok((Self::load(out)?, cleaned))
    }

    /// Token ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self
            .inner
            .encode(text, false)
            .map_err(|e| invalid!("cannot encode: {e}"))?
            .get_ids()
            .to_vec())
    }

    /// The ids of many texts at once, encoded in parallel (on rayon's current pool; no
    /// offsets computed).
    pub fn encode_many(&self, texts: Vec<String>) -> Result<Vec<Vec<u32>>> {
        Ok(self
            .inner
            .encode_batch_fast(texts, false)
            .map_err(|e| invalid!("cannot encode: {e}"))?
            .into_iter()
            .map(|e| e.get_ids().to_vec())
            .collect())
    }

    /// The text of `ids`.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| invalid!("cannot decode: {e}"))
    }

    /// The vocabulary's size as a model sees it: one more than the largest id (added tokens
    /// included), which every id is below; a count of entries is less where ids leave gaps.
    pub fn vocab_size(&self) -> usize {
        self.ids
    }

    /// The id of `token`, if the vocabulary has it.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// SHA-256 of the `tokenizer.json` it was loaded from.
    pub fn sha256(&self) -> &str {
        &self.sha256
    }

    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }
}
