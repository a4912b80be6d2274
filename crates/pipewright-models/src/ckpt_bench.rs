//! The checkpoint benchmark (`pipewright bench ckpt`): a GPT's checkpoint (about 100M
//! parameters with AdamW state by default) saved and loaded beside a plain sequential write
//! and read of the same bytes on the same disk in the same run, and the training stall of a
//! background save as a share of a synchronous one: ratios measured side by side, as the
//! house measures speed.

use std::fmt;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::checkpoint::{CheckpointOptions, Manifest};
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::optim::{AdamW, AdamWConfig, Optimizer};
use pipewright::{invalid, Batch, Error, Result};

use crate::{gpt, GptConfig, TIED};

/// What the benchmark measures and where.
#[derive(Clone, Debug)]
pub struct CkptBench {
    /// GPT layers (d 768, 12 heads, vocabulary 16384: 12 layers make about 110M parameters).
    pub n_layer: usize,
    /// An existing directory on the disk to measure: the benchmark writes into a new
    /// subdirectory of it and removes only that.
    pub dir: PathBuf,
    /// Training steps run while a background save writes.
    pub steps_during_async: u64,
}

/// Seconds of each part, measured in one run.
#[derive(Clone, Copy, Debug)]
pub struct CkptBenchReport {
    /// The model's parameters.
    pub params: usize,
    /// Bytes of tensors in the checkpoint.
    pub bytes: usize,
    /// A synchronous save.
    pub save: f64,
    /// A plain sequential write and fsync of as many bytes.
    pub write: f64,
    /// A load of the checkpoint.
    pub load: f64,
    /// A plain sequential read of the plain file.
    pub read: f64,
    /// A background save's call, until it returns (the snapshot).
    pub start: f64,
    /// The wait at the end for the background save, after the steps.
    pub finish: f64,
    /// The steps trained while it wrote.
    pub trained: f64,
    /// How many steps those were.
    pub steps: u64,
}

fn secs(f: impl FnOnce() -> Result<()>) -> Result<f64> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

/// Writes `bytes` bytes to `path` in one sequential pass and fsyncs: the plain-I/O baseline.
fn plain_write(path: &Path, bytes: usize) -> Result<()> {
    let buf = vec![7u8; 64 << 20];
    let mut f = std::fs::File::create(path).map_err(|e| Error::io("cannot create", path, e))?;
    let mut left = bytes;
    while left > 0 {
        let n = left.min(buf.len());
        f.write_all(&buf[..n])
            .map_err(|e| Error::io("cannot write", path, e))?;
        left -= n;
    }
    f.sync_all().map_err(|e| Error::io("cannot sync", path, e))
}

fn plain_read(path: &Path) -> Result<()> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io("cannot open", path, e))?;
    let mut buf = vec![0u8; 64 << 20];
    while f
        .read(&mut buf)
        .map_err(|e| Error::io("cannot read", path, e))?
        > 0
    {}
    Ok(())
}

impl CkptBench {
    /// Runs the benchmark in a fresh subdirectory of [`CkptBench::dir`], removed after.
    pub fn run(&self) -> Result<CkptBenchReport> {
        let cfg = GptConfig {
            vocab_size: 16384,
            block_size: 64,
            n_layer: self.n_layer,
            n_head: 12,
            n_embd: 768,
            dropout: 0.0,
        };
        // The model, its optimizer state and the copies a save and a load make.
        pipewright::runtime::memory::check_fits(
            cfg.param_count() as f64 * 40.0,
            &format!("a checkpoint benchmark of {} GPT layers", self.n_layer),
            "fewer --n-layer",
        )?;
        // The disk to measure is one that is there: a mistyped path is not made.
        if !self.dir.is_dir() {
            return Err(invalid!(
                "--dir `{}` is not a directory: name an existing directory on the disk to \
                 measure (the benchmark writes into a new subdirectory of it)",
                self.dir.display()
            ));
        }
        // Its own subdirectory, new: the user's files in the directory are never touched.
        let scratch = (self.dir).join(format!("pipewright-bench-ckpt-{}", std::process::id()));
        std::fs::create_dir(&scratch).map_err(|e| Error::io("cannot create", &scratch, e))?;
        let report = self.measure(cfg, &scratch);
        let _ = std::fs::remove_dir_all(&scratch);
        report
    }

    /// Every timing, on one rank, in `dir`.
    fn measure(&self, cfg: GptConfig, dir: &Path) -> Result<CkptBenchReport> {
        let opts = VarunaOptions {
            shared_weights: vec![(TIED.0.into(), TIED.1.into())],
            ..VarunaOptions::new(Layout::new(1, 1, 1)?, 1, 1)
        };
        let cpu = pipewright::candle_core::Device::Cpu;
        let ids = pipewright::candle_core::Tensor::arange(0u32, 16, &cpu)?.reshape((1, 16))?;
        let targets = ids.to_dtype(pipewright::candle_core::DType::I64)?;
        let batch = Batch::pair(ids, targets);
        let model = gpt(cfg)?;
        let rows = local::run(1, |comm| {
            let mut v = Varuna::new(&model, Box::new(comm), opts.clone())?;
            v.set_optimizer(|ps| {
                Ok(Box::new(AdamW::new(ps, AdamWConfig::default())?) as Box<dyn Optimizer>)
            })?;
            v.step(&batch)?; // AdamW moments exist from here on
            let params = v.pipeline().total_params()?;
            let none = CheckpointOptions::default();
            let mut saved = PathBuf::new();
            let save = secs(|| {
                saved = v.checkpoint(&dir.join("sync"), &none)?;
                Ok(())
            })?;
            let bytes = Manifest::read(&saved)?.bytes() as usize;
            let plain = dir.join("plain.bin");
            let write = secs(|| plain_write(&plain, bytes))?;
            let load = secs(|| v.load_checkpoint(&saved).map(|_| ()))?;
            let read = secs(|| plain_read(&plain))?;
            // Background save: the stall is the call itself plus whatever finishing still
            // waits after some training steps.
            let start = secs(|| v.checkpoint_async(&dir.join("async"), &none))?;
            let mut trained = 0.0;
            for _ in 0..self.steps_during_async {
                trained += secs(|| v.step(&batch).map(|_| ()))?;
            }
            let finish = secs(|| v.finish_checkpoint().map(|_| ()))?;
            Ok(CkptBenchReport {
                params,
                bytes,
                save,
                write,
                load,
                read,
                start,
                finish,
                trained,
                steps: self.steps_during_async,
            })
        })?;
        Ok(rows[0])
    }
}

impl fmt::Display for CkptBenchReport {
    /// The table: seconds, GB/s and the ratio to the plain I/O of each part, then the
    /// background save's stall.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (params, bytes) = (self.params, self.bytes);
        let gb = bytes as f64 / 1e9;
        writeln!(
            f,
            "checkpoint of a GPT with {params} parameters and AdamW state: {bytes} bytes of tensors"
        )?;
        writeln!(
            f,
            "{:<28} {:>10} {:>10} {:>8}",
            "", "seconds", "GB/s", "ratio"
        )?;
        let rows = [
            (
                "save (pipewright)",
                self.save,
                format!("{:.2}", self.write / self.save),
            ),
            ("plain sequential write+fsync", self.write, "1".into()),
            (
                "load (pipewright)",
                self.load,
                format!("{:.2}", self.read / self.load),
            ),
            ("plain sequential read", self.read, "1".into()),
        ];
        for (what, s, ratio) in rows {
            writeln!(f, "{what:<28} {s:>10.3} {:>10.3} {ratio:>8}", gb / s)?;
        }
        let stall = self.start + self.finish;
        write!(
            f,
            "async save: {:.3} s to snapshot and return, {:.3} s waiting at the end after {} \
             steps ({:.1} s): stall {:.0} % of the synchronous save",
            self.start,
            self.finish,
            self.steps,
            self.trained,
            100.0 * stall / self.save
        )
    }
}
