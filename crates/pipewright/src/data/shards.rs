//! A corpus encoded once into token shards: `train-NNNNN.bin` and `valid-NNNNN.bin`, raw
//! little-endian u16 or u32 ids (nanoGPT's `.bin`), each at most `shard_tokens` long, and
//! `index.json` ([`ShardIndex`]: the tokenizer's checksum, the dtype, every shard's token
//! count, the documents). Each document of the corpus (a text file, a JSON line, a Parquet row:
//! [`super::documents`]) is ended by [`super::END_OF_TEXT`]. The held-out split is the last
//! `held_out` share of the corpus's text bytes, or the documents of the files named apart
//! ([`PrepareOptions::valid`]).
//!
//! The corpus streams ([`super::corpus`]): documents are read in pieces of about `chunk_bytes`
//! (cut after a newline where one is near, and at the held-out split's first byte exactly) on a
//! reading thread, batches of pieces are encoded in parallel on a pool of `workers` threads and
//! appended to the shards in their order, so the shards are the same bytes for any number of
//! workers and memory holds a few batches and one shard's buffer whatever the corpus's size.
//! Everything is written into a temporary directory renamed into place at the end: a failed or
//! killed run leaves nothing.

use serde::{Deserialize, Serialize};

use super::corpus::InvalidUtf8;
use super::documents::Corpus;

/// The version of the shard format this build writes and reads.
pub const SHARD_FORMAT: u32 = 1;
/// The index's file name in a shard directory.
pub const INDEX_FILE: &str = "index.json";

/// How token ids are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenDtype {
    /// Two bytes: vocabularies of at most 65,536.
    U16,
    /// Four bytes.
    U32,
}

impl TokenDtype {
    /// Bytes per id.
    pub fn bytes(self) -> usize {
        match self {
            Self::U16 => 2,
            Self::U32 => 4,
        }
    }

    /// The smallest that holds ids below `vocab`.
    pub fn for_vocab(vocab: usize) -> Self {
        if vocab <= 1 << 16 {
            Self::U16
        } else {
            Self::U32
        }
    }
}

crate::runtime::words::word_enum!(TokenDtype, "token dtype", {
    U16 => "u16",
    U32 => "u32",
});

/// One shard file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardFile {
    /// Its name in the shard directory.
    pub file: String,
    /// Token ids it holds.
    pub tokens: u64,
}

/// `index.json` of a shard directory.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ShardIndex {
    /// [`SHARD_FORMAT`] of the writer.
    pub format_version: u32,
    /// SHA-256 of the `tokenizer.json` that encoded it.
    pub tokenizer_sha256: String,
    /// The tokenizer's vocabulary (every id is below it).
    pub vocab_size: usize,
    /// How ids are stored.
    pub dtype: TokenDtype,
    /// The id ending every document.
    pub eos: u32,
    /// Documents (files of the corpus).
    pub documents: u64,
    /// Bytes of text encoded.
    pub bytes: u64,
    /// The training split's shards, in order.
    pub train: Vec<ShardFile>,
    /// The held-out split's shards, in order.
    pub valid: Vec<ShardFile>,
    /// Bytes that were not UTF-8, replaced by U+FFFD (`--invalid-utf8 replace`).
    #[serde(default)]
    pub replaced_bytes: u64,
    /// Documents left out as not UTF-8 (`--invalid-utf8 skip`).
    #[serde(default)]
    pub skipped_documents: u64,
}

/// How [`super::prepare`] cuts and stores a corpus.
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    /// Ids per shard file at most.
    pub shard_tokens: usize,
    /// Share of the corpus's bytes held out (its end).
    pub held_out: f64,
    /// Bytes read and encoded as one piece (cut after a newline).
    pub chunk_bytes: usize,
    /// How ids are stored (the smallest that holds the vocabulary when `None`).
    pub dtype: Option<TokenDtype>,
    /// What to do with bytes that are not UTF-8.
    pub invalid_utf8: InvalidUtf8,
    /// The held-out documents, named apart (`data prepare --valid`): the whole corpus then
    /// trains, and `held_out` must be 0.
    pub valid: Option<Corpus>,
    /// Threads encoding (0: one per core).
    pub workers: usize,
}

impl Default for PrepareOptions {
    /// 16 Mi ids per shard, 5 % held out, 1 MiB pieces, a worker per core.
    fn default() -> Self {
        Self {
            shard_tokens: 1 << 24,
            held_out: 0.05,
            chunk_bytes: 1 << 20,
            dtype: None,
            invalid_utf8: InvalidUtf8::Error,
            valid: None,
            workers: 0,
        }
    }
}
