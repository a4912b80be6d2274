//! What a corpus file holds, by its name: plain text (the file one document), JSON lines
//! (`.jsonl`, `.json`, `.ndjson`: a document per line, its text in a string field) or Parquet
//! (`.parquet`: a document per row, its text in a string column, read a row group's batch at
//! a time), each also gzip- (`.gz`) or zstd-compressed (`.zst`, `.zstd`; a compressed Parquet
//! file is decompressed into a temporary file first, as Parquet is read by seeking). A
//! [`Corpus`] names the files and the field; [`FileDocuments`] gives one file's documents in
//! order, each as a stream of its text's bytes, which [`super::corpus::Pieces`] cuts into
//! pieces alike whatever the format, so a document encodes to the same ids from any of them.

use std::fs::File;
use std::io::{BufRead, BufReader, Cursor, Read};
use std::path::{Path, PathBuf};

use arrow_array::{Array, LargeStringArray, RecordBatch, StringArray, StringViewArray};
use arrow_schema::DataType;
use parquet::arrow::arrow_reader::{ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder};
use parquet::arrow::ProjectionMask;

use crate::{invalid, Error, Result};

/// The files of a corpus and where their text is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Corpus {
    /// The files, in order (each format known by its name).
    pub files: Vec<PathBuf>,
    /// The JSON field or Parquet column holding a document's text.
    pub text_field: String,
}

impl Corpus {
    /// `files`, their text in the field `text` (Hugging Face's and FineWeb's).
    pub fn new(files: Vec<PathBuf>) -> Self {
        Self {
            files,
            text_field: "text".into(),
        }
    }
}

/// How a file's documents are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// The file is one document.
    Text,
    /// A JSON object per line.
    JsonLines,
    /// A Parquet file, a document per row.
    Parquet,
}

/// How a file is compressed, besides its format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    /// Not at all.
    None,
    /// gzip (`.gz`).
    Gzip,
    /// Zstandard (`.zst`, `.zstd`).
    Zstd,
}

/// The format and compression of `path`, by its name (anything unnamed is text).
pub fn format_of(path: &Path) -> (Format, Compression) {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let (stem, compression) = match name.rsplit_once('.') {
        Some((stem, "gz")) => (stem.to_string(), Compression::Gzip),
        Some((stem, "zst" | "zstd")) => (stem.to_string(), Compression::Zstd),
        _ => (name, Compression::None),
    };
    let format = match stem.rsplit_once('.').map(|(_, e)| e) {
        Some("jsonl" | "json" | "ndjson") => Format::JsonLines,
        Some("parquet") => Format::Parquet,
        _ => Format::Text,
    };
    (format, compression)
}

/// `path`'s bytes, decompressed as its name says.
pub fn open_stream(path: &Path) -> Result<Box<dyn Read + Send>> {
    let f = File::open(path).map_err(|e| Error::io("cannot read corpus file", path, e))?;
    Ok(match format_of(path).1 {
        Compression::None => Box::new(f),
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(BufReader::new(f))),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::new(f)
                .map_err(|e| Error::io("cannot read zstd stream", path, e))?,
        ),
    })
}

/// One document: its text's bytes, and what names it in an error (the file, and its line or
/// row).
pub struct Document {
    /// The text, streamed.
    pub text: Box<dyn Read + Send>,
    /// `file` or `file, line N` or `file, row N`.
    pub name: String,
}

/// The documents of one file, in order.
pub enum FileDocuments {
    /// The whole file, until taken.
    Text(Option<Document>),
    /// One JSON object per line.
    Lines {
        /// The decompressed file.
        reader: BufReader<Box<dyn Read + Send>>,
        /// The field holding the text.
        field: String,
        /// Lines read so far.
        line: u64,
        /// The file.
        path: PathBuf,
    },
    /// Rows of a Parquet file's text column.
    Parquet {
        /// Batches of the column, row group by row group.
        reader: ParquetRecordBatchReader,
        /// The batch being read and the next row in it.
        batch: Option<(RecordBatch, usize)>,
        /// Rows given so far.
        row: u64,
        /// The file.
        path: PathBuf,
    },
}

impl FileDocuments {
    /// The documents of `path`, their text in `field` (JSON lines, Parquet).
    pub fn open(path: &Path, field: &str) -> Result<Self> {
        let path_buf = path.to_path_buf();
        Ok(match format_of(path).0 {
            Format::Text => Self::Text(Some(Document {
                text: open_stream(path)?,
                name: format!("`{}`", path.display()),
            })),
            Format::JsonLines => Self::Lines {
                reader: BufReader::with_capacity(1 << 20, open_stream(path)?),
                field: field.to_string(),
                line: 0,
                path: path_buf,
            },
            Format::Parquet => Self::Parquet {
                reader: parquet_reader(path, field)?,
                batch: None,
                row: 0,
                path: path_buf,
            },
        })
    }

    /// The next document, or `None` after the last.
    pub fn next_document(&mut self) -> Result<Option<Document>> {
        match self {
            Self::Text(doc) => Ok(doc.take()),
            Self::Lines {
                reader,
                field,
                line,
                path,
            } => next_line(reader, field, line, path),
            Self::Parquet {
                reader,
                batch,
                row,
                path,
            } => next_row(reader, batch, row, path),
        }
    }
}

/// The text of the next non-blank line of a JSON lines file.
fn next_line(
    reader: &mut BufReader<Box<dyn Read + Send>>,
    field: &str,
    line: &mut u64,
    path: &Path,
) -> Result<Option<Document>> {
    let mut buf = Vec::new();
    loop {
        buf.clear();
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|e| invalid!("cannot read `{}`: {e}", path.display()))?;
        if n == 0 {
            return Ok(None);
        }
        *line += 1;
        if buf.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let at = || format!("`{}`, line {line}", path.display());
        let value: serde_json::Value = serde_json::from_slice(&buf)
            .map_err(|e| invalid!("{}: not a JSON object: {e}", at()))?;
        let text = match value.get(field) {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(other) => {
                return Err(invalid!(
                    "{}: the field `{field}` holds {}, not text: give the field that does with \
                     --text-field",
                    at(),
                    json_kind(other)
                ))
            }
            None => {
                return Err(invalid!(
                    "{}: no field `{field}`: give the field holding the text with --text-field",
                    at()
                ))
            }
        };
        return Ok(Some(Document {
            text: Box::new(Cursor::new(text.into_bytes())),
            name: at(),
        }));
    }
}

/// What a JSON value is, in words.
fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// `path` as a file Parquet can seek in: itself, or (gzip or zstd outside, which Parquet's
/// reader cannot seek through) its bytes decompressed into a temporary file, unlinked as soon
/// as it is open so that nothing is left behind whatever happens.
fn seekable(path: &Path) -> Result<File> {
    if format_of(path).1 == Compression::None {
        return File::open(path).map_err(|e| Error::io("cannot read corpus file", path, e));
    }
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = std::env::temp_dir().join(format!("pipewright-{}-{n}.parquet", std::process::id()));
    let copied = (|| {
        let mut out = File::create(&tmp).map_err(|e| Error::io("cannot create", &tmp, e))?;
        std::io::copy(&mut open_stream(path)?, &mut out)
            .map_err(|e| invalid!("cannot read `{}`: {e}", path.display()))?;
        File::open(&tmp).map_err(|e| Error::io("cannot read", &tmp, e))
    })();
    let _ = std::fs::remove_file(&tmp);
    copied
}

/// Batches of rows of `path`'s string column `field` (no other column read).
fn parquet_reader(path: &Path, field: &str) -> Result<ParquetRecordBatchReader> {
    let f = seekable(path)?;
    let not = |e: parquet::errors::ParquetError| {
        invalid!(
            "`{}` is not a Parquet file it can read: {e}",
            path.display()
        )
    };
    let builder = ParquetRecordBatchReaderBuilder::try_new(f).map_err(not)?;
    let schema = builder.schema().clone();
    let Some((index, column)) = schema.column_with_name(field) else {
        let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
        return Err(invalid!(
            "`{}` has no column `{field}` (its columns: {}): give the one holding the text \
             with --text-field",
            path.display(),
            names.join(", ")
        ));
    };
    if !matches!(
        column.data_type(),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
    ) {
        return Err(invalid!(
            "`{}`: the column `{field}` holds {}, not strings: give the column holding the text \
             with --text-field",
            path.display(),
            column.data_type()
        ));
    }
    // The column's leaf in the file's own schema (a flat string column is one leaf).
    let leaf = builder
        .parquet_schema()
        .columns()
        .iter()
        .position(|c| c.path().parts().first().map(String::as_str) == Some(field))
        .unwrap_or(index);
    let mask = ProjectionMask::leaves(builder.parquet_schema(), [leaf]);
    builder
        .with_projection(mask)
        .with_batch_size(1024)
        .build()
        .map_err(not)
}

/// The next row's text of a Parquet file (a null row is an error, as a JSON line's null).
fn next_row(
    reader: &mut ParquetRecordBatchReader,
    batch: &mut Option<(RecordBatch, usize)>,
    row: &mut u64,
    path: &Path,
) -> Result<Option<Document>> {
    loop {
        if let Some((b, next)) = batch.as_mut() {
            let column = b.column(0);
            if *next < b.num_rows() {
                let i = *next;
                *next += 1;
                *row += 1;
                // As a JSON line whose field holds null: an error, never a row dropped unsaid.
                if column.is_null(i) {
                    return Err(invalid!(
                        "`{}`, row {row}: the text column holds null, not text: drop such rows \
                         from the file, or give the column that holds the text with --text-field",
                        path.display()
                    ));
                }
                let text = string_at(column.as_ref(), i).ok_or_else(|| {
                    invalid!("`{}`: the text column is not strings", path.display())
                })?;
                return Ok(Some(Document {
                    text: Box::new(Cursor::new(text.into_bytes())),
                    name: format!("`{}`, row {row}", path.display()),
                }));
            }
        }
        match reader.next() {
            Some(b) => {
                let b = b.map_err(|e| invalid!("cannot read `{}`: {e}", path.display()))?;
                *batch = Some((b, 0));
            }
            None => return Ok(None),
        }
    }
}

/// The string at row `i` of a string column of any width.
fn string_at(column: &dyn Array, i: usize) -> Option<String> {
    let any = column.as_any();
    if let Some(a) = any.downcast_ref::<StringArray>() {
        return Some(a.value(i).to_string());
    }
    if let Some(a) = any.downcast_ref::<LargeStringArray>() {
        return Some(a.value(i).to_string());
    }
    any.downcast_ref::<StringViewArray>()
        .map(|a| a.value(i).to_string())
}

/// Bytes of text in `corpus`: plain files by their size, the others read through once.
pub fn text_bytes(corpus: &Corpus) -> Result<u64> {
    let mut total = 0u64;
    for f in &corpus.files {
        total += match format_of(f) {
            (Format::Text, Compression::None) => std::fs::metadata(f)
                .map_err(|e| Error::io("cannot read corpus file", f, e))?
                .len(),
            _ => {
                let mut docs = FileDocuments::open(f, &corpus.text_field)?;
                let mut n = 0u64;
                while let Some(mut d) = docs.next_document()? {
                    n += std::io::copy(&mut d.text, &mut std::io::sink())
                        .map_err(|e| invalid!("cannot read {}: {e}", d.name))?;
                }
                n
            }
        };
    }
    Ok(total)
}
