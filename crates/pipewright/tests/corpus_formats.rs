//! Corpora in the formats they ship in: the same documents written as text files (the oracle),
//! JSON lines (plain, gzip, zstd), Parquet of several row groups and a mix of them (a
//! zstd-compressed Parquet file among them) prepare to
//! the same shards byte for byte, with 1, 2 and 4 workers alike; a malformed line, a missing or
//! non-text field, a non-string column, truncated gzip and zstd streams and a file that is not
//! Parquet are clear errors that leave nothing behind.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::{Int64Array, RecordBatch, StringArray};
use arrow_schema::{DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::file::properties::WriterProperties;
use pipewright::data::{prepare, Corpus, InvalidUtf8, PrepareOptions, Tokenizer};

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pw-formats-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// 30 documents of a few hundred bytes, some over several lines, some not ASCII.
fn documents() -> Vec<String> {
    (0..30)
        .map(|i| {
            let mut d = String::new();
            for j in 0..(3 + i % 5) {
                d.push_str(&format!(
                    "document {i} line {j}: the quick brown fox {} jumps over {} lazy dogs",
                    ["and", "then", "or", "não", "ünd"][(i + j) % 5],
                    i * j
                ));
                d.push(if j % 3 == 2 { ' ' } else { '\n' });
            }
            d
        })
        .collect()
}

fn opts(workers: usize) -> PrepareOptions {
    PrepareOptions {
        shard_tokens: 700,
        held_out: 0.2,
        // Pieces cut inside documents: the cutting must be the same from every format.
        chunk_bytes: 150,
        workers,
        ..Default::default()
    }
}

fn text_files(dir: &Path, docs: &[String], prefix: &str, gz: bool) -> Vec<PathBuf> {
    docs.iter()
        .enumerate()
        .map(|(i, d)| {
            let p = dir.join(format!("{prefix}{i:02}.txt{}", if gz { ".gz" } else { "" }));
            let bytes = match gz {
                true => gzip(d.as_bytes()),
                false => d.as_bytes().to_vec(),
            };
            std::fs::write(&p, bytes).unwrap();
            p
        })
        .collect()
}

fn json_lines(docs: &[String]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, d) in docs.iter().enumerate() {
        let line = serde_json::json!({"id": i, "text": d, "meta": {"n": i}});
        writeln!(out, "{line}").unwrap();
        if i == 3 {
            out.extend_from_slice(b"\n");
        }
    }
    out
}

fn gzip(b: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(b).unwrap();
    e.finish().unwrap()
}

fn zstd(b: &[u8]) -> Vec<u8> {
    zstd::stream::encode_all(b, 3).unwrap()
}

/// A Parquet file of `docs` in row groups of 7, beside an integer column `id`.
fn parquet(path: &Path, docs: &[String]) {
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("text", DataType::Utf8, false),
    ]));
    let batch = RecordBatch::try_new(
        schema.clone(),
        vec![
            Arc::new(Int64Array::from_iter_values(0..docs.len() as i64)),
            Arc::new(StringArray::from_iter_values(docs)),
        ],
    )
    .unwrap();
    let props = WriterProperties::builder()
        .set_max_row_group_row_count(Some(7))
        .build();
    let f = std::fs::File::create(path).unwrap();
    let mut w = ArrowWriter::try_new(f, schema, Some(props)).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
}

/// Every file of a shard directory, by name.
fn shards(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    v
}

fn run(tok: &Tokenizer, corpus: &Corpus, out: &Path, workers: usize) -> pipewright::Result<()> {
    prepare(tok, corpus, out, &opts(workers), &mut |_, _, _| {}).map(|_| ())
}

#[test]
fn every_format_prepares_to_the_shards_of_the_same_documents_in_text() {
    let d = tmp("same");
    let docs = documents();
    let txt = Corpus::new(text_files(&d, &docs, "doc-", false));
    let (tok, _) = Tokenizer::train(&txt, 300, &d.join("tok.json"), InvalidUtf8::Error).unwrap();
    run(&tok, &txt, &d.join("from-txt"), 2).unwrap();
    let want = shards(&d.join("from-txt"));
    assert!(want.len() > 3, "several shards: {}", want.len());
    let lines = json_lines(&docs);
    let write = |name: &str, bytes: Vec<u8>| {
        let p = d.join(name);
        std::fs::write(&p, bytes).unwrap();
        Corpus::new(vec![p])
    };
    parquet(&d.join("all.parquet"), &docs);
    let mixed = {
        let mut files = vec![d.join("mix-a.jsonl.zst")];
        std::fs::write(&files[0], zstd(&json_lines(&docs[..10]))).unwrap();
        parquet(&d.join("mix-b.parquet"), &docs[10..20]);
        let bytes = std::fs::read(d.join("mix-b.parquet")).unwrap();
        files.push(d.join("mix-b.parquet.zst"));
        std::fs::write(&files[1], zstd(&bytes)).unwrap();
        files.extend(text_files(&d, &docs[20..], "mix-c-", true));
        Corpus::new(files)
    };
    for (what, corpus) in [
        ("jsonl", write("all.jsonl", lines.clone())),
        ("jsonl.gz", write("all.jsonl.gz", gzip(&lines))),
        ("jsonl.zst", write("all.jsonl.zst", zstd(&lines))),
        ("parquet", Corpus::new(vec![d.join("all.parquet")])),
        ("a mix", mixed),
    ] {
        let out = d.join(format!("from-{what}"));
        run(&tok, &corpus, &out, 2).unwrap_or_else(|e| panic!("{what}: {e}"));
        assert!(
            shards(&out) == want,
            "{what}: other shards than the text files'"
        );
    }
    // The tokenizer learns the same from JSON lines as from the text files.
    let json = Corpus::new(vec![d.join("all.jsonl")]);
    let (other, _) =
        Tokenizer::train(&json, 300, &d.join("tok2.json"), InvalidUtf8::Error).unwrap();
    assert_eq!(other.sha256(), tok.sha256());
    // Any number of workers writes the same bytes.
    for workers in [1, 4] {
        let out = d.join(format!("workers-{workers}"));
        run(&tok, &txt, &out, workers).unwrap();
        assert!(shards(&out) == want, "{workers} workers");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn broken_files_are_clear_errors_that_leave_nothing() {
    let d = tmp("broken");
    let docs = documents();
    let txt = Corpus::new(text_files(&d, &docs[..5], "doc-", false));
    let (tok, _) = Tokenizer::train(&txt, 280, &d.join("tok.json"), InvalidUtf8::Error).unwrap();
    let lines = json_lines(&docs);
    let truncated = |b: Vec<u8>| b[..b.len() * 2 / 3].to_vec();
    parquet(&d.join("ok.parquet"), &docs);
    // A row whose text is null, as a JSON line's: an error, not a row dropped unsaid.
    let schema = Arc::new(Schema::new(vec![Field::new("text", DataType::Utf8, true)]));
    let rows = StringArray::from(vec![Some(docs[0].as_str()), None]);
    let batch = RecordBatch::try_new(schema.clone(), vec![Arc::new(rows)]).unwrap();
    let f = std::fs::File::create(d.join("null.parquet")).unwrap();
    let mut w = ArrowWriter::try_new(f, schema, None).unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();
    let cases: Vec<(&str, Vec<u8>, &str, &str)> = vec![
        (
            "null.parquet",
            Vec::new(),
            "text",
            "row 2: the text column holds null, not text",
        ),
        (
            "null.jsonl",
            b"{\"text\": null}\n".to_vec(),
            "text",
            "holds null, not text",
        ),
        (
            "bad.jsonl",
            b"{\"text\": \"a\"}\n{\"text\": \n".to_vec(),
            "text",
            "line 2: not a JSON object",
        ),
        (
            "missing.jsonl",
            b"{\"content\": \"a\"}\n".to_vec(),
            "text",
            "line 1: no field `text`",
        ),
        (
            "number.jsonl",
            b"{\"text\": 7}\n".to_vec(),
            "text",
            "holds a number, not text",
        ),
        (
            "cut.jsonl.gz",
            truncated(gzip(&lines)),
            "text",
            "cannot read",
        ),
        (
            "cut.jsonl.zst",
            truncated(zstd(&lines)),
            "text",
            "cannot read",
        ),
        (
            "cut.txt.gz",
            truncated(gzip(docs[0].as_bytes())),
            "text",
            "cannot read",
        ),
        (
            "not.parquet",
            b"hello, not parquet".to_vec(),
            "text",
            "is not a Parquet file",
        ),
        (
            "ok.parquet",
            Vec::new(),
            "id",
            "the column `id` holds Int64, not strings",
        ),
        (
            "ok.parquet",
            Vec::new(),
            "body",
            "has no column `body` (its columns: id, text)",
        ),
    ];
    for (name, bytes, field, says) in cases {
        let p = d.join(name);
        if !bytes.is_empty() {
            std::fs::write(&p, bytes).unwrap();
        }
        let corpus = Corpus {
            files: vec![txt.files[0].clone(), p],
            text_field: field.into(),
        };
        let out = d.join("out");
        let e = run(&tok, &corpus, &out, 2).expect_err(name).to_string();
        assert!(e.contains(says), "{name}: `{says}` not in: {e}");
        assert!(e.contains(name), "{name}: the file is not named: {e}");
        assert!(!out.exists(), "{name}: wrote {}", out.display());
        let left: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp"))
            .collect();
        assert!(left.is_empty(), "{name}: left {left:?}");
    }
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn held_out_documents_named_apart_are_the_valid_split_whole() {
    let d = tmp("valid");
    let docs = documents();
    let train = Corpus::new(text_files(&d, &docs[..25], "train-", false));
    std::fs::write(d.join("held.jsonl"), json_lines(&docs[25..])).unwrap();
    let valid = Corpus::new(vec![d.join("held.jsonl")]);
    let (tok, _) = Tokenizer::train(&train, 300, &d.join("tok.json"), InvalidUtf8::Error).unwrap();
    let opts = PrepareOptions {
        held_out: 0.0,
        valid: Some(valid.clone()),
        ..opts(2)
    };
    let index = prepare(&tok, &train, &d.join("s"), &opts, &mut |_, _, _| {}).unwrap();
    assert_eq!(index.documents, 30);
    let ids = |files: &[pipewright::data::shards::ShardFile]| -> Vec<u32> {
        files
            .iter()
            .flat_map(|f| {
                let b = std::fs::read(d.join("s").join(&f.file)).unwrap();
                b.chunks(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
                    .collect::<Vec<_>>()
            })
            .collect()
    };
    let eos = index.eos;
    let text = |ids: Vec<u32>| -> Vec<String> {
        ids.split(|&i| i == eos)
            .filter(|s| !s.is_empty())
            .map(|s| tok.decode(s).unwrap())
            .collect()
    };
    assert_eq!(text(ids(&index.valid)), docs[25..].to_vec());
    assert_eq!(text(ids(&index.train)), docs[..25].to_vec());
    // With a held-out share too, it is refused.
    let both = PrepareOptions {
        held_out: 0.1,
        ..opts.clone()
    };
    let e = prepare(&tok, &train, &d.join("s2"), &both, &mut |_, _, _| {}).unwrap_err();
    assert!(e.to_string().contains("give one"), "{e}");
    // A held-out file that is also a training file (named another way) holds out nothing.
    let same = PrepareOptions {
        valid: Some(Corpus::new(vec![d
            .join(".")
            .join(train.files[3].file_name().unwrap())])),
        ..opts.clone()
    };
    let e = prepare(&tok, &train, &d.join("s3"), &same, &mut |_, _, _| {}).unwrap_err();
    assert!(
        e.to_string()
            .contains("both a training file and a held-out one"),
        "{e}"
    );
    std::fs::remove_dir_all(&d).unwrap();
}
