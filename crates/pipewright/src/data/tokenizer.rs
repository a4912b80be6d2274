//! Tokenizers in Hugging Face's `tokenizer.json` format, through its own Rust crate: train a
//! byte-level BPE on a corpus (GPT-2's kind: every byte is a token, so any text encodes and
//! decodes back exactly), or load any `tokenizer.json` a user brings. Nothing is downloaded.

use std::path::{Path, PathBuf};

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, TokenizerBuilder};

use crate::{invalid, Error, Result};

/// The token that ends every document of a prepared corpus (GPT-2's).
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// A loaded tokenizer and the checksum of its file (what token shards record, so that shards
/// are never read with another tokenizer).
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    sha256: String,
    path: PathBuf,
}

fn tok_err<'a>(what: &'a str, path: &'a Path) -> impl Fn(tokenizers::Error) -> Error + 'a {
    let what = what.to_string();
    move |e| invalid!("{what} `{}`: {e}", path.display())
}

impl Tokenizer {
    /// Loads the `tokenizer.json` at `path`.
    pub fn load(path: &Path) -> Result<Self> {
        let bytes = std::fs::read(path).map_err(|e| Error::io("cannot read tokenizer", path, e))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes).map_err(tok_err(
            "not a tokenizer.json (Hugging Face's format)",
            path,
        ))?;
        Ok(Self {
            inner,
            sha256: crate::checkpoint::format::sha256(&bytes),
            path: path.to_path_buf(),
        })
    }

    /// Trains a byte-level BPE of `vocab_size` tokens (the 256 bytes, [`END_OF_TEXT`] and the
    /// merges) on the text files `files`, and writes it to `out` as `tokenizer.json`.
    pub fn train(files: &[PathBuf], vocab_size: usize, out: &Path) -> Result<Self> {
        if files.is_empty() {
            return Err(invalid!(
                "no files to train a tokenizer on: name at least one"
            ));
        }
        if vocab_size < 257 {
            return Err(invalid!(
                "a byte-level BPE needs a vocabulary of at least 257 (the 256 bytes and {END_OF_TEXT}), got {vocab_size}"
            ));
        }
        super::corpus_bytes(files)?;
        crate::files::ensure_new(out, "--out")?;
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
        let names = files
            .iter()
            .map(|f| f.to_string_lossy().into_owned())
            .collect();
        tok.train_from_files(&mut trainer, names)
            .map_err(|e| invalid!("training the tokenizer failed: {e}"))?;
        let tmp = out.with_extension("json.tmp");
        tokenizers::Tokenizer::from(tok)
            .save(&tmp, true)
            .map_err(tok_err("cannot write", &tmp))?;
        std::fs::rename(&tmp, out).map_err(|e| Error::io("cannot rename into", out, e))?;
        Self::load(out)
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

    /// The ids of many texts at once, encoded in parallel.
    pub fn encode_many(&self, texts: Vec<String>) -> Result<Vec<Vec<u32>>> {
        Ok(self
            .inner
            .encode_batch(texts, false)
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

    /// Tokens in the vocabulary, added ones included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
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
