//! Preparing a corpus ([`prepare`]): its shards (see [`super::shards`] for the format) written
//! from pieces read on a thread of their own, encoded in batches on a pool of workers and
//! appended in order, into a temporary directory renamed into place at the end.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver};

use super::corpus::InvalidUtf8;
use super::corpus::{Pieces, RUN_ON};
use super::documents::Corpus;
use super::shards::{PrepareOptions, ShardFile, ShardIndex, TokenDtype, INDEX_FILE, SHARD_FORMAT};
use super::tokenizer::{Tokenizer, END_OF_TEXT};
use crate::{invalid, Error, Result};

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

/// Pieces to encode: (text, split, whether it ends its document), and the corpus's text bytes
/// read once they are.
type Batch = (Vec<(String, usize, bool)>, u64);

/// What the reading thread found besides its batches: documents read, bytes replaced.
#[derive(Default)]
struct Read {
    documents: u64,
    replaced_bytes: u64,
}

/// Reads `parts` into batches of about `batch_bytes` sent to `tx`, in order: the training
/// corpus with its last `held_out` share of text bytes held out (cut exactly there), or the
/// training corpus whole then the held-out documents named apart.
fn read_batches(
    parts: &Parts,
    opts: &PrepareOptions,
    batch_bytes: usize,
    tx: std::sync::mpsc::SyncSender<Result<Batch>>,
) -> Read {
    let mut read = Read::default();
    let (mut pending, mut pending_bytes, mut offset) = (Vec::new(), 0usize, 0u64);
    let (corpus, total) = parts.train;
    let threshold = match parts.valid {
        Some(_) => u64::MAX,
        None => (total as f64 * (1.0 - opts.held_out)).floor() as u64,
    };
    let mut sources: Vec<(&Corpus, Option<usize>)> = vec![(corpus, None)];
    if let Some((v, _)) = parts.valid {
        sources.push((v, Some(1)));
    }
    for (corpus, fixed) in sources {
        let mut pieces = Pieces::new(corpus, opts.invalid_utf8, opts.chunk_bytes);
        loop {
            let split = fixed.unwrap_or(usize::from(offset >= threshold));
            // The training split ends at the threshold itself, newline or not (a corpus of one
            // line ran on past it and held nothing out).
            if fixed.is_none() && split == 0 {
                let left = threshold.saturating_sub(offset).max(1);
                let size = left.min(opts.chunk_bytes as u64);
                pieces.set_limit(size as usize, left - size);
            } else {
                pieces.set_limit(opts.chunk_bytes, RUN_ON);
            }
            let p = match pieces.next() {
                None => break,
                Some(Err(e)) => {
                    let _ = tx.send(Err(e));
                    return read;
                }
                Some(Ok(p)) => p,
            };
            offset += p.bytes;
            if !p.text.is_empty() {
                pending_bytes += p.text.len();
                pending.push((p.text, split, false));
            }
            if p.ends_document {
                // The document's end, after its last piece.
                pending.push((String::new(), split, true));
                read.documents += 1;
            }
            if pending_bytes >= batch_bytes || pending.len() >= 1024 {
                pending_bytes = 0;
                if tx.send(Ok((std::mem::take(&mut pending), offset))).is_err() {
                    return read;
                }
            }
        }
        read.replaced_bytes += pieces.cleaned.replaced_bytes;
    }
    let _ = tx.send(Ok((pending, offset)));
    read
}

/// What [`prepare`] tells its caller after every batch: text bytes read, of the total, and
/// ids written.
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64, u64);

/// Encodes the batches from `rx` on `pool` and appends them to `splits` in order, telling
/// `progress` the bytes read of `total` and the ids written.
fn encode_batches(
    tok: &Tokenizer,
    rx: Receiver<Result<Batch>>,
    pool: &rayon::ThreadPool,
    (splits, eos): (&mut [Writer; 2], u32),
    (total, progress): (u64, Progress),
) -> Result<()> {
    let mut tokens = 0u64;
    for batch in rx {
        let (pending, offset) = batch?;
        let (texts, ends): (Vec<String>, Vec<(usize, bool)>) =
            pending.into_iter().map(|(t, s, end)| (t, (s, end))).unzip();
        let ids = pool.install(|| tok.encode_many(texts))?;
        for (ids, (s, end)) in ids.into_iter().zip(ends) {
            splits[s].push(&ids)?;
            tokens += ids.len() as u64 + u64::from(end);
            if end {
                splits[s].push(&[eos])?;
            }
        }
        progress(offset.min(total), total, tokens);
    }
    Ok(())
}

/// Writes the shards of `parts` into `dir` (see the module's text) and gives their index.
fn write_shards(
    tok: &Tokenizer,
    parts: &Parts,
    dir: &Path,
    opts: &PrepareOptions,
    (dtype, eos): (TokenDtype, u32),
    progress: Progress,
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
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let workers = if opts.workers == 0 {
        cores
    } else {
        opts.workers
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(workers)
        .build()
        .map_err(|e| invalid!("cannot start {workers} encoding threads: {e}"))?;
    // Batches of about two pieces' worth of bytes per worker (many small documents make one
    // batch, so that the workers stay busy); two wait while one is encoded.
    let batch_bytes = 2 * workers * opts.chunk_bytes;
    let total = parts.train.1 + parts.valid.map_or(0, |v| v.1);
    let (tx, rx) = sync_channel(2);
    let (read, encoded) = std::thread::scope(|s| {
        let reader = s.spawn(|| read_batches(parts, opts, batch_bytes, tx));
        let encoded = encode_batches(tok, rx, &pool, (&mut splits, eos), (total, &mut *progress));
        (reader.join(), encoded)
    });
    let read = read.map_err(|_| invalid!("the corpus's reading thread failed"))?;
    encoded?;
    let written = |w: &Writer| {
        w.files.iter().map(|f| f.tokens).sum::<u64>() + w.buf.len() as u64 / dtype.bytes() as u64
    };
    progress(total, total, splits.iter().map(written).sum());
    for w in &mut splits {
        w.flush()?;
    }
    let [train, valid] = splits;
    let has_text = |w: &Writer| w.files.iter().map(|f| f.tokens).sum::<u64>() > 1;
    if !has_text(&train) || !has_text(&valid) {
        return Err(match parts.valid {
            Some(_) => invalid!("the held-out documents (--valid) hold no text"),
            None => invalid!(
                "the corpus of {total} bytes is too small to hold out {} % of it: give more \
                 text or a larger held-out share",
                opts.held_out * 100.0
            ),
        });
    }
    Ok(ShardIndex {
        format_version: SHARD_FORMAT,
        tokenizer_sha256: tok.sha256().to_string(),
        vocab_size: tok.vocab_size(),
        dtype,
        eos,
        documents: read.documents,
        bytes: total,
        replaced_bytes: read.replaced_bytes,
        skipped_documents: 0,
        train: train.files,
        valid: valid.files,
    })
}

/// Encodes the documents of `corpus` with `tok` into a new shard directory `out`; `progress`
/// is told the text bytes done, the total and the ids written after every batch of pieces.
pub fn prepare(
    tok: &Tokenizer,
    corpus: &Corpus,
    out: &Path,
    opts: &PrepareOptions,
    progress: Progress,
) -> Result<ShardIndex> {
    crate::runtime::files::ensure_new(out, "--out")?;
    if corpus.files.is_empty() || opts.valid.as_ref().is_some_and(|v| v.files.is_empty()) {
        return Err(invalid!("no corpus files: name at least one"));
    }
    if !(0.0..1.0).contains(&opts.held_out) || opts.shard_tokens == 0 || opts.chunk_bytes == 0 {
        return Err(invalid!(
            "held_out must lie in [0, 1), shard_tokens and chunk_bytes must be positive"
        ));
    }
    if opts.valid.is_some() && opts.held_out > 0.0 {
        return Err(invalid!(
            "held-out documents named apart (--valid) and a held-out share (--held-out) \
             together: give one"
        ));
    }
    if let Some(v) = &opts.valid {
        // A held-out file that is also trained on holds out nothing: the evaluation would
        // measure the training set.
        let real = |p: &PathBuf| p.canonicalize().unwrap_or_else(|_| p.clone());
        let trained: std::collections::HashSet<PathBuf> = corpus.files.iter().map(real).collect();
        if let Some(both) = v.files.iter().find(|f| trained.contains(&real(f))) {
            return Err(invalid!(
                "`{}` is both a training file and a held-out one (--valid): hold out files \
                 that are not in the corpus, or a share of it (--held-out)",
                both.display()
            ));
        }
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
    let skip = |c: &Corpus| match opts.invalid_utf8 {
        InvalidUtf8::Skip => super::corpus::utf8_files(c),
        _ => Ok((c.clone(), Default::default())),
    };
    let (corpus, skipped) = skip(corpus)?;
    let valid = opts.valid.as_ref().map(skip).transpose()?;
    let total = super::corpus_bytes(&corpus)?;
    let valid_total = valid
        .as_ref()
        .map(|(v, _)| super::corpus_bytes(v))
        .transpose()?;
    let name = out
        .file_name()
        .map_or("shards".into(), |n| n.to_string_lossy().into_owned());
    let tmp = out.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io("cannot create", &tmp, e))?;
    let parts = Parts {
        train: (&corpus, total),
        valid: valid.as_ref().map(|(v, _)| v).zip(valid_total),
    };
    let result =
        write_shards(tok, &parts, &tmp, opts, (dtype, eos), progress).and_then(|mut index| {
            index.skipped_documents =
                skipped.skipped_documents + valid.as_ref().map_or(0, |(_, c)| c.skipped_documents);
            let text = serde_json::to_string_pretty(&index).map_err(|e| invalid!("{e}"))?;
            let ip = tmp.join(INDEX_FILE);
            std::fs::write(&ip, text).map_err(|e| Error::io("cannot write", &ip, e))?;
            let _ = std::fs::remove_dir(out);
            std::fs::rename(&tmp, out).map_err(|e| Error::io("cannot rename into", out, e))?;
            Ok(index)
        });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

/// What a prepared directory is made of: the corpus and its text bytes, and the held-out
/// documents named apart with theirs.
struct Parts<'a> {
    pub train: (&'a Corpus, u64),
    pub valid: Option<(&'a Corpus, u64)>,
}
