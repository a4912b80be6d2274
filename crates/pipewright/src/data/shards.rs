//! A corpus encoded once into token shards: `train-NNNNN.bin` and `valid-NNNNN.bin`, raw
//! little-endian u16 or u32 ids (nanoGPT's `.bin`), each at most `shard_tokens` long, and
//! `index.json` ([`ShardIndex`]: the tokenizer's checksum, the dtype, every shard's token
//! count, the documents). Each file of the corpus is a document, ended by
//! [`super::END_OF_TEXT`]. The last `held_out` share of the corpus's bytes is the held-out
//! split.
//!
//! The corpus streams ([`super::corpus`]): files are read in chunks of about `chunk_bytes` (cut
//! after a newline where one is near, and at the held-out split's first byte exactly),
//! a few chunks at a time are encoded in parallel and appended to the shards, so memory holds a
//! few chunks and one shard's buffer whatever the corpus's size. Everything is written into a
//! temporary directory renamed into place at the end: a failed or killed run leaves nothing.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::corpus::{InvalidUtf8, Pieces, RUN_ON};
use super::tokenizer::{Tokenizer, END_OF_TEXT};
use crate::{invalid, Error, Result};

/// The version of the shard format this build writes and reads.
pub const SHARD_FORMAT: u32 = 1;
/// The index's file name in a shard directory.
pub const INDEX_FILE: &str = "index.json";

/// How token ids are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
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

impl std::str::FromStr for TokenDtype {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "u16" => Ok(Self::U16),
            "u32" => Ok(Self::U32),
            _ => Err(invalid!("token dtype `{s}`: give u16 or u32")),
        }
    }
}

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

/// How [`prepare`] cuts and stores a corpus.
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
}

impl Default for PrepareOptions {
    /// 16 Mi ids per shard, 5 % held out, 1 MiB pieces.
    fn default() -> Self {
        Self {
            shard_tokens: 1 << 24,
            held_out: 0.05,
            chunk_bytes: 1 << 20,
            dtype: None,
            invalid_utf8: InvalidUtf8::Error,
        }
    }
}

/// Appends ids to the shards of one split.
struct Writer {
    dir: PathBuf,
    split: &'static str,
    dtype: TokenDtype,
    shard_tokens: usize,
    buf: Vec<u8>,
    files: Vec<ShardFile>,
}

impl Writer {
    fn push(&mut self, ids: &[u32]) -> Result<()> {
        for &id in ids {
            match self.dtype {
                TokenDtype::U16 if id > u16::MAX as u32 => {
                    return Err(invalid!(
                        "token id {id} does not fit in u16 ids (65,535 at most): store u32"
                    ))
                }
                TokenDtype::U16 => self.buf.extend_from_slice(&(id as u16).to_le_bytes()),
                TokenDtype::U32 => self.buf.extend_from_slice(&id.to_le_bytes()),
            }
            if self.buf.len() == self.shard_tokens * self.dtype.bytes() {
                self.flush()?;
            }
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let file = format!("{}-{:05}.bin", self.split, self.files.len());
        let path = self.dir.join(&file);
        let mut f =
            std::fs::File::create(&path).map_err(|e| Error::io("cannot create", &path, e))?;
        f.write_all(&self.buf)
            .and_then(|_| f.sync_all())
            .map_err(|e| Error::io("cannot write", &path, e))?;
        let tokens = (self.buf.len() / self.dtype.bytes()) as u64;
        self.files.push(ShardFile { file, tokens });
        self.buf.clear();
        Ok(())
    }
}

/// Encodes the text files `files` with `tok` into a new shard directory `out`; `progress` is
/// told the bytes done and the total after every batch of pieces.
pub fn prepare(
    tok: &Tokenizer,
    files: &[PathBuf],
    out: &Path,
    opts: &PrepareOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ShardIndex> {
    crate::runtime::files::ensure_new(out, "--out")?;
    if files.is_empty() {
        return Err(invalid!("no corpus files: name at least one"));
    }
    if !(0.0..1.0).contains(&opts.held_out) || opts.shard_tokens == 0 || opts.chunk_bytes == 0 {
        return Err(invalid!(
            "held_out must lie in [0, 1), shard_tokens and chunk_bytes must be positive"
        ));
    }
    let vocab = tok.vocab_size();
    let dtype = opts.dtype.unwrap_or(TokenDtype::for_vocab(vocab));
    if dtype == TokenDtype::U16 && vocab > 1 << 16 {
        return Err(invalid!(
            "a vocabulary of {vocab} does not fit in u16 ids (65,536 at most): store u32"
        ));
    }
    let eos = tok.token_id(END_OF_TEXT).ok_or_else(|| {
        invalid!(
            "the tokenizer `{}` has no {END_OF_TEXT} token to end documents with: add it as a \
             special token",
            tok.path().display()
        )
    })?;
    // Skipped documents are left out before the split is placed in the bytes that are read.
    let (files, skipped) = match opts.invalid_utf8 {
        InvalidUtf8::Skip => super::corpus::utf8_files(files)?,
        _ => (files.to_vec(), Default::default()),
    };
    let total = super::corpus_bytes(&files)?;
    let name = out
        .file_name()
        .map_or("shards".into(), |n| n.to_string_lossy().into_owned());
    let tmp = out.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io("cannot create", &tmp, e))?;
    let result = write_shards(tok, &files, &tmp, opts, (dtype, eos, total), progress).and_then(
        |mut index| {
            index.skipped_documents = skipped.skipped_documents;
            let text = serde_json::to_string_pretty(&index).map_err(|e| invalid!("{e}"))?;
            let ip = tmp.join(INDEX_FILE);
            std::fs::write(&ip, text).map_err(|e| Error::io("cannot write", &ip, e))?;
            let _ = std::fs::remove_dir(out);
            std::fs::rename(&tmp, out).map_err(|e| Error::io("cannot rename into", out, e))?;
            Ok(index)
        },
    );
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

fn write_shards(
    tok: &Tokenizer,
    files: &[PathBuf],
    dir: &Path,
    opts: &PrepareOptions,
    (dtype, eos, total): (TokenDtype, u32, u64),
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ShardIndex> {
    let writer = |split| Writer {
        dir: dir.to_path_buf(),
        split,
        dtype,
        shard_tokens: opts.shard_tokens,
        buf: Vec::new(),
        files: Vec::new(),
    };
    let mut splits = [writer("train"), writer("valid")];
    // Pieces starting at or after this byte of the corpus are held out.
    let threshold = (total as f64 * (1.0 - opts.held_out)).floor() as u64;
    // Pieces are encoded in batches of about two pieces' worth of bytes per core (many small
    // documents make one batch, so that the cores stay busy).
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let batch_bytes = 2 * cores * opts.chunk_bytes;
    let mut pending_bytes = 0usize;
    let mut offset = 0u64;
    // (text, split, ends its document)
    let mut pending: Vec<(String, usize, bool)> = Vec::new();
    let flush = |pending: &mut Vec<(String, usize, bool)>, splits: &mut [Writer; 2]| {
        let (texts, ends): (Vec<String>, Vec<(usize, bool)>) =
            pending.drain(..).map(|(t, s, end)| (t, (s, end))).unzip();
        for (ids, (s, end)) in tok.encode_many(texts)?.into_iter().zip(ends) {
            splits[s].push(&ids)?;
            if end {
                splits[s].push(&[eos])?;
            }
        }
        Ok::<(), Error>(())
    };
    let mut pieces = Pieces::new(files, opts.invalid_utf8, opts.chunk_bytes);
    loop {
        let split = usize::from(offset >= threshold);
        // The training split ends at the threshold itself, newline or not (a corpus of one
        // line ran on past it and held nothing out).
        let left = threshold.saturating_sub(offset).max(1);
        match split {
            0 => {
                let size = left.min(opts.chunk_bytes as u64);
                pieces.set_limit(size as usize, left - size);
            }
            _ => pieces.set_limit(opts.chunk_bytes, RUN_ON),
        }
        let Some(p) = pieces.next().transpose()? else {
            break;
        };
        offset += p.bytes;
        if !p.text.is_empty() {
            pending_bytes += p.text.len();
            pending.push((p.text, split, false));
        }
        if p.ends_document {
            // The document's end, after its last piece.
            pending.push((String::new(), split, true));
        }
        if pending_bytes >= batch_bytes || pending.len() >= 1024 {
            pending_bytes = 0;
            flush(&mut pending, &mut splits)?;
            progress(offset, total);
        }
    }
    flush(&mut pending, &mut splits)?;
    progress(total, total);
    for w in &mut splits {
        w.flush()?;
    }
    let [train, valid] = splits;
    let has_text = |w: &Writer| w.files.iter().map(|f| f.tokens).sum::<u64>() > 1;
    if !has_text(&train) || !has_text(&valid) {
        return Err(invalid!(
            "the corpus of {total} bytes is too small to hold out {} % of it: give more text \
             or a larger held-out share",
            opts.held_out * 100.0
        ));
    }
    Ok(ShardIndex {
        format_version: SHARD_FORMAT,
        tokenizer_sha256: tok.sha256().to_string(),
        vocab_size: tok.vocab_size(),
        dtype,
        eos,
        documents: files.len() as u64,
        bytes: total,
        replaced_bytes: pieces.cleaned.replaced_bytes,
        skipped_documents: 0,
        train: train.files,
        valid: valid.files,
    })
}
