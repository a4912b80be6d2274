//! A corpus's text, read the one way both `data tokenizer` and `data prepare` read it: its
//! documents in order (a text file is one, a JSON line or a Parquet row one:
//! [`super::documents`]), each streamed in pieces of bounded size (cut after a newline where
//! one is near, else at a character boundary), so a single line or document larger than memory
//! is read like any other and a document cuts alike from any format. Bytes that are not UTF-8 are handled by one policy ([`InvalidUtf8`]): an error
//! naming the file and the byte offset (the default), replaced by U+FFFD, or the whole document
//! skipped; [`Cleaned`] counts what was replaced or skipped.

use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use super::documents::{format_of, open_stream, Corpus, FileDocuments, Format};
use crate::{invalid, Error, Result};

/// What to do with bytes of the corpus that are not UTF-8 text.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InvalidUtf8 {
    /// Fail, naming the file and the byte offset.
    #[default]
    Error,
    /// Replace each invalid sequence by U+FFFD.
    Replace,
    /// Leave out every document (file) that holds one.
    Skip,
}

crate::runtime::words::word_enum!(InvalidUtf8, "--invalid-utf8 choice", {
    Error => "error",
    Replace => "replace",
    Skip => "skip",
});

/// What [`InvalidUtf8::Replace`] and [`InvalidUtf8::Skip`] changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cleaned {
    /// Bytes replaced by U+FFFD.
    pub replaced_bytes: u64,
    /// Documents left out.
    pub skipped_documents: u64,
    /// Their bytes.
    pub skipped_bytes: u64,
}

impl std::fmt::Display for Cleaned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} bytes that were not UTF-8 replaced, {} documents ({} bytes) skipped",
            self.replaced_bytes, self.skipped_documents, self.skipped_bytes
        )
    }
}

/// How far a piece runs on past its size to end at a newline, at most.
pub const RUN_ON: u64 = 1 << 16;

/// One piece of a document.
pub struct Piece {
    /// Its text.
    pub text: String,
    /// Bytes of the file it consumed.
    pub bytes: u64,
    /// Whether it is its document's last (then possibly empty).
    pub ends_document: bool,
}

/// The corpus's pieces, document after document ([`Iterator`] of `Result<Piece>`).
pub struct Pieces {
    corpus: Corpus,
    policy: InvalidUtf8,
    /// The next piece's size, and how far past it it may run on to the next newline.
    limit: (usize, u64),
    next_file: usize,
    /// The documents of the file being read.
    docs: Option<FileDocuments>,
    /// The document being read, and its name for errors.
    open: Option<BufReader<Box<dyn Read + Send>>>,
    name: String,
    /// Bytes read but not yet given (a character cut at a piece's end).
    rest: Vec<u8>,
    /// Where `rest` starts in the open file.
    offset: u64,
    /// What the policy changed so far.
    pub cleaned: Cleaned,
}

/// `corpus` without its text files that are not UTF-8 throughout (a streamed pass over each;
/// JSON and Parquet text is UTF-8 by their formats), and what leaving them out skips: what
/// [`InvalidUtf8::Skip`] reads, known before reading (for a split by share of the bytes that
/// are read).
pub fn utf8_files(corpus: &Corpus) -> Result<(Corpus, Cleaned)> {
    let mut cleaned = Cleaned::default();
    let mut kept = Vec::new();
    for f in &corpus.files {
        if format_of(f).0 == Format::Text && Pieces::first_invalid(f)?.is_some() {
            cleaned.skipped_documents += 1;
            cleaned.skipped_bytes += std::fs::metadata(f).map_or(0, |m| m.len());
        } else {
            kept.push(f.clone());
        }
    }
    let kept = Corpus {
        files: kept,
        ..corpus.clone()
    };
    Ok((kept, cleaned))
}

/// Bytes at the end of `b` that begin a character they do not finish (0 to 3).
fn incomplete_tail(b: &[u8]) -> usize {
    for k in 1..=b.len().min(3) {
        let c = b[b.len() - k];
        if c & 0xC0 == 0x80 {
            continue;
        }
        let need = match c {
            0xF0.. => 4,
            0xE0.. => 3,
            0xC0.. => 2,
            _ => 1,
        };
        return if need > k { k } else { 0 };
    }
    0
}

impl Pieces {
    /// The pieces of `corpus`'s documents (about `limit` bytes each), `policy` for bytes that
    /// are not UTF-8.
    pub fn new(corpus: &Corpus, policy: InvalidUtf8, limit: usize) -> Self {
        Self {
            corpus: corpus.clone(),
            policy,
            limit: (limit.max(1), RUN_ON),
            next_file: 0,
            docs: None,
            open: None,
            name: String::new(),
            rest: Vec::new(),
            offset: 0,
            cleaned: Cleaned::default(),
        }
    }

    /// The size of the next piece, and how many bytes past it it may run on to end at a
    /// newline (at most [`RUN_ON`]); where it finds none, it ends at a character boundary.
    pub fn set_limit(&mut self, limit: usize, run_on: u64) {
        self.limit = (limit.max(1), run_on.min(RUN_ON));
    }

    /// The first byte of the text file `path` that is not UTF-8 (streamed, decompressed, in
    /// bounded memory), if any.
    fn first_invalid(path: &Path) -> Result<Option<u64>> {
        let (mut r, mut carry, mut at) = (open_stream(path)?, Vec::new(), 0u64);
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = r
                .read(&mut buf)
                .map_err(|e| Error::io("cannot read", path, e))?;
            carry.extend_from_slice(&buf[..n]);
            let keep = if n == 0 { 0 } else { incomplete_tail(&carry) };
            let upto = carry.len() - keep;
            if let Err(e) = std::str::from_utf8(&carry[..upto]) {
                return Ok(Some(at + e.valid_up_to() as u64));
            }
            if n == 0 {
                return Ok(None);
            }
            at += upto as u64;
            carry.drain(..upto);
        }
    }

    /// Opens the next document to read, leaving out the text files [`InvalidUtf8::Skip`]
    /// skips.
    fn open_next(&mut self) -> Result<bool> {
        loop {
            if self.docs.is_none() {
                let Some(path) = self.corpus.files.get(self.next_file).cloned() else {
                    return Ok(false);
                };
                self.next_file += 1;
                let text = format_of(&path).0 == Format::Text;
                if self.policy == InvalidUtf8::Skip && text && Self::first_invalid(&path)?.is_some()
                {
                    self.cleaned.skipped_documents += 1;
                    self.cleaned.skipped_bytes += std::fs::metadata(&path).map_or(0, |m| m.len());
                    continue;
                }
                self.docs = Some(FileDocuments::open(&path, &self.corpus.text_field)?);
            }
            match self.docs.as_mut().map(FileDocuments::next_document) {
                Some(Ok(Some(d))) => {
                    self.open = Some(BufReader::new(d.text));
                    self.name = d.name;
                    self.offset = 0;
                    return Ok(true);
                }
                Some(Err(e)) => return Err(e),
                _ => self.docs = None,
            }
        }
    }

    /// The next raw bytes of the open document: about the limit, run on to a newline.
    fn read(&mut self) -> Result<Vec<u8>> {
        let (limit, run_on) = self.limit;
        let r = self.open.as_mut().expect("a document is open");
        let mut v = Vec::with_capacity(limit.min(1 << 20));
        let name = &self.name;
        let what = |e| invalid!("cannot read {name}: {e}");
        r.take(limit as u64).read_to_end(&mut v).map_err(what)?;
        if run_on > 0 && v.len() == limit && v.last() != Some(&b'\n') {
            r.take(run_on).read_until(b'\n', &mut v).map_err(what)?;
        }
        Ok(v)
    }

    /// The text of `bytes`, read at `self.offset` of the open document: a cut
    /// character at the end goes back to `rest` unless `last`; invalid bytes by the policy.
    fn decode(&mut self, mut bytes: Vec<u8>, last: bool) -> Result<String> {
        if !last {
            let cut = incomplete_tail(&bytes);
            self.rest = bytes.split_off(bytes.len() - cut);
        }
        let start = self.offset;
        self.offset += bytes.len() as u64;
        match String::from_utf8(bytes) {
            Ok(s) => Ok(s),
            Err(e) => {
                let at = start + e.utf8_error().valid_up_to() as u64;
                let bytes = e.into_bytes();
                if self.policy != InvalidUtf8::Replace {
                    return Err(invalid!(
                        "{} is not UTF-8 text: byte {at} (0x{:02x}) is not part of a \
                         character; pass --invalid-utf8 replace (U+FFFD for such bytes) or skip \
                         (leave such files out), or remove the file from the corpus",
                        self.name,
                        bytes[(at - start) as usize]
                    ));
                }
                for chunk in bytes.utf8_chunks() {
                    self.cleaned.replaced_bytes += chunk.invalid().len() as u64;
                }
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
        }
    }
}

impl Iterator for Pieces {
    type Item = Result<Piece>;

    fn next(&mut self) -> Option<Result<Piece>> {
        let step = |me: &mut Self| -> Result<Option<Piece>> {
            if me.open.is_none() && !me.open_next()? {
                return Ok(None);
            }
            let more = me.read()?;
            let last = more.is_empty();
            let mut bytes = std::mem::take(&mut me.rest);
            bytes.extend(more);
            let n = bytes.len() as u64;
            let text = me.decode(bytes, last)?;
            if last {
                me.open = None;
            }
            Ok(Some(Piece {
                bytes: n - me.rest.len() as u64,
                text,
                ends_document: last,
            }))
        };
        step(self).transpose()
    }
}
