//! `pipewright data`: a tokenizer trained on a corpus, and the corpus encoded into token shards
//! that `pipewright train --task tokens --data DIR` trains on.

use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use pipewright::data::{prepare, Corpus, InvalidUtf8, PrepareOptions, TokenDtype, Tokenizer};
use pipewright::Result;

#[derive(Subcommand)]
pub enum DataCommand {
    /// Train a byte-level BPE tokenizer on text files into Hugging Face's `tokenizer.json`.
    Tokenizer(TokenizerArgs),
    /// Encode text files with a tokenizer into token shards and their index.
    Prepare(PrepareArgs),
    /// List the training windows each step of `train --task tokens` reads, for a run elsewhere
    /// (PyTorch's, tools/run_parity.py) to train on the same batches.
    Windows(WindowsArgs),
}

#[derive(Args)]
pub struct WindowsArgs {
    /// The shard directory, or a blend `0.7:A,0.3:B`, as `train --data` (a blend's rows are
    /// listed as SOURCE:WINDOW, SOURCE counted from 0 in the blend's order).
    #[arg(long)]
    pub data: PathBuf,
    /// Tokens per window, as `train --block-size`.
    #[arg(long, value_parser = crate::train::positive)]
    pub block_size: usize,
    /// Rows per step, as `train --batch-size`.
    #[arg(long, value_parser = crate::train::positive)]
    pub batch_size: usize,
    /// Steps to list.
    #[arg(long, value_parser = crate::train::positive_u64)]
    pub steps: u64,
    /// The run's --seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// The CSV to write (a new file): a row per step, the step (counted from 1, as
    /// `scalars.csv` counts) and its rows' window indices. Window w is ids
    /// [w x block, (w + 1) x block] (inputs, then targets one later) of the training shards
    /// laid end to end in name order.
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Args)]
pub struct TokenizerArgs {
    /// Tokens in the vocabulary (the 256 bytes, <|endoftext|> and the merges).
    #[arg(long, default_value_t = 4096)]
    pub vocab_size: usize,
    /// The `tokenizer.json` to write (a new file).
    #[arg(long)]
    pub out: PathBuf,
    /// Bytes that are not UTF-8: error (name the file and byte), replace (by U+FFFD) or skip
    /// (leave such files out).
    #[arg(long, default_value = "error")]
    pub invalid_utf8: InvalidUtf8,
    /// The JSON field or Parquet column holding each document's text.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// Corpus files, or directories of them (read recursively): text (a file a document), JSON
    /// lines (.jsonl, .json: a document a line) or Parquet (.parquet: a document a row), each
    /// also gzip- (.gz) or zstd-compressed (.zst).
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
}

#[derive(Args)]
pub struct PrepareArgs {
    /// The `tokenizer.json` to encode with (`data tokenizer` makes one; any other loads too).
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// The shard directory to write (new, or empty).
    #[arg(long)]
    pub out: PathBuf,
    /// Share of the corpus (its last bytes of text) held out for evaluation (default 0.05).
    #[arg(long, value_parser = crate::train::finite, conflicts_with = "valid")]
    pub held_out: Option<f64>,
    /// Hold out this file's documents (a file or a directory, as the corpus's; repeat for
    /// more) instead of a share of the corpus, which then trains whole.
    #[arg(long, value_name = "FILE")]
    pub valid: Vec<PathBuf>,
    /// Threads encoding (default: one per core); the shards are the same bytes for any number.
    #[arg(long, default_value_t = 0)]
    pub workers: usize,
    /// Ids per shard file at most.
    #[arg(long, default_value_t = 1 << 24)]
    pub shard_tokens: usize,
    /// How ids are stored: u16 or u32 (default: the smallest that holds the vocabulary).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Bytes that are not UTF-8: error (name the file and byte), replace (by U+FFFD) or skip
    /// (leave such files out).
    #[arg(long, default_value = "error")]
    pub invalid_utf8: InvalidUtf8,
    /// The JSON field or Parquet column holding each document's text.
    #[arg(long, default_value = "text")]
    pub text_field: String,
    /// Corpus files, or directories of them (read recursively): text (a file a document), JSON
    /// lines (.jsonl, .json: a document a line) or Parquet (.parquet: a document a row), each
    /// also gzip- (.gz) or zstd-compressed (.zst).
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
}

pub fn run(c: DataCommand) -> Result<()> {
    match c {
        DataCommand::Tokenizer(a) => {
            let corpus = Corpus::walk(&a.files, &a.text_field)?;
            let (tok, cleaned) = Tokenizer::train(&corpus, a.vocab_size, &a.out, a.invalid_utf8)?;
            pipewright::say!(
                "wrote {} (byte-level BPE, {} tokens, from {} files)",
                a.out.display(),
                tok.vocab_size(),
                corpus.files.len()
            );
            if cleaned != Default::default() {
                pipewright::say!("text that was not UTF-8: {cleaned}");
            }
            Ok(())
        }
        DataCommand::Prepare(a) => prepare_shards(&a),
        DataCommand::Windows(a) => windows(&a),
    }
}

fn windows(a: &WindowsArgs) -> Result<()> {
    // A blend (`0.7:A,0.3:B`, as train's --data) lists each row as SOURCE:WINDOW; one
    // directory is a blend of one, which reads what it reads alone.
    let blend = pipewright_models::flags::blend_of(&a.data)?;
    let sources = !blend.is_empty();
    let parts = if sources {
        blend
    } else {
        vec![(1.0, a.data.clone())]
    };
    pipewright::runtime::files::ensure_new(&a.out, "--out")?;
    let run = (a.steps, a.batch_size, a.block_size, a.seed);
    let csv = pipewright::data::blend::windows_csv(&parts, run, sources)?;
    pipewright::runtime::files::write_atomic(&a.out, csv.as_bytes())?;
    pipewright::say!(
        "wrote {}: {} steps of {} windows of {} ids from `{}` (seed {})",
        a.out.display(),
        a.steps,
        a.batch_size,
        a.block_size,
        a.data.display(),
        a.seed
    );
    Ok(())
}

fn prepare_shards(a: &PrepareArgs) -> Result<()> {
    let tok = Tokenizer::load(&a.tokenizer)?;
    let corpus = Corpus::walk(&a.files, &a.text_field)?;
    let valid = match a.valid.is_empty() {
        true => None,
        false => Some(Corpus::walk(&a.valid, &a.text_field)?),
    };
    let opts = PrepareOptions {
        held_out: a
            .held_out
            .unwrap_or(if valid.is_some() { 0.0 } else { 0.05 }),
        shard_tokens: a.shard_tokens,
        dtype: a
            .dtype
            .as_deref()
            .map(str::parse::<TokenDtype>)
            .transpose()?,
        invalid_utf8: a.invalid_utf8,
        valid,
        workers: a.workers,
        ..Default::default()
    };
    let start = Instant::now();
    let mut shown = Progress::new();
    let index = prepare(&tok, &corpus, &a.out, &opts, &mut |done, total, tokens| {
        shown.show(done, total, tokens)
    })?;
    shown.finish();
    let secs = start.elapsed().as_secs_f64();
    let count = |s: &[pipewright::data::shards::ShardFile]| s.iter().map(|f| f.tokens).sum::<u64>();
    let (train, valid) = (count(&index.train), count(&index.valid));
    pipewright::say!(
        "wrote {}: {train} training and {valid} held-out tokens ({:?}) in {} shards from {} documents, {:.0} tokens/s",
        a.out.display(),
        index.dtype,
        index.train.len() + index.valid.len(),
        index.documents,
        (train + valid) as f64 / secs.max(1e-9)
    );
    if index.replaced_bytes + index.skipped_documents > 0 {
        pipewright::say!(
            "text that was not UTF-8: {} bytes replaced, {} documents skipped",
            index.replaced_bytes,
            index.skipped_documents
        );
    }
    Ok(())
}

/// Progress of a preparation: a bar with tokens per second and the time left on a terminal,
/// else a line a minute (a log keeps a few lines, not a bar's redraws).
struct Progress {
    bar: Option<ProgressBar>,
    started: Instant,
    last_line: Instant,
}

impl Progress {
    fn new() -> Self {
        use std::io::IsTerminal;
        let bar = std::io::stderr().is_terminal().then(|| {
            let pb = ProgressBar::new(0);
            pb.set_style(
                ProgressStyle::with_template("{bar:30} {bytes}/{total_bytes} {msg} [{eta}]")
                    .expect("valid template"),
            );
            pb
        });
        let now = Instant::now();
        Self {
            bar,
            started: now,
            last_line: now,
        }
    }

    /// `done` bytes of text of `total` read, `tokens` written.
    fn show(&mut self, done: u64, total: u64, tokens: u64) {
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        let per_s = tokens as f64 / secs;
        if let Some(pb) = &self.bar {
            pb.set_length(total);
            pb.set_position(done);
            pb.set_message(format!("{per_s:.0} tokens/s"));
            return;
        }
        if self.last_line.elapsed().as_secs() >= 60 && done < total {
            self.last_line = Instant::now();
            let left = (total - done) as f64 * secs / done.max(1) as f64;
            pipewright::say!(
                "prepared {:.1} of {:.1} MB of text: {tokens} tokens, {per_s:.0} tokens/s, about \
                 {left:.0} s left",
                done as f64 / 1e6,
                total as f64 / 1e6,
            );
        }
    }

    fn finish(&self) {
        if let Some(pb) = &self.bar {
            pb.finish_and_clear();
        }
    }
}
