//! `pipewright bench ckpt`: checkpoint save and load bandwidth of a GPT (about 100M parameters
//! with AdamW state by default) beside a plain sequential write and read of the same bytes in
//! the same run, and the training stall of a background save as a fraction of a synchronous
//! one.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::Args;
use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::checkpoint::{CheckpointOptions, Manifest};
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::optim::{AdamW, AdamWConfig, Optimizer};
use pipewright::{Batch, Error, Result};
use pipewright_models::{gpt, GptConfig, TIED};

#[derive(Args)]
pub struct CkptBenchArgs {
    /// GPT layers (d 768, 12 heads, vocabulary 16384: 12 layers make about 110M parameters).
    #[arg(long, default_value_t = 12)]
    pub n_layer: usize,
    /// The directory to write in (the disk measured; by default the current one, which
    /// exists wherever the command runs): the benchmark makes a fresh subdirectory there and
    /// removes only that.
    #[arg(long, default_value = ".")]
    pub dir: PathBuf,
    /// Training steps run while a background save writes.
    #[arg(long, default_value_t = 2)]
    pub steps_during_async: u64,
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

pub fn run(a: CkptBenchArgs) -> Result<()> {
    let cfg = GptConfig {
        vocab_size: 16384,
        block_size: 64,
        n_layer: a.n_layer,
        n_head: 12,
        n_embd: 768,
        dropout: 0.0,
    };
    // The model, its optimizer state and the copies a save and a load make.
    pipewright::runtime::memory::check_fits(
        cfg.param_count() as f64 * 40.0,
        &format!("a checkpoint benchmark of {} GPT layers", a.n_layer),
        "fewer --n-layer",
    )?;
    // The disk to measure is one that is there: a mistyped path is not made.
    if !a.dir.is_dir() {
        return Err(pipewright::invalid!(
            "--dir `{}` is not a directory: name an existing directory on the disk to measure \
             (the benchmark writes into a new subdirectory of it)",
            a.dir.display()
        ));
    }
    // Its own subdirectory, new: the user's files in --dir are never touched.
    let scratch = a
        .dir
        .join(format!("pipewright-bench-ckpt-{}", std::process::id()));
    std::fs::create_dir(&scratch).map_err(|e| Error::io("cannot create", &scratch, e))?;
    let opts = VarunaOptions {
        shared_weights: vec![(TIED.0.into(), TIED.1.into())],
        ..VarunaOptions::new(Layout::new(1, 1, 1)?, 1, 1)
    };
    let ids =
        pipewright::candle_core::Tensor::arange(0u32, 16, &pipewright::candle_core::Device::Cpu)?
            .reshape((1, 16))?;
    let targets = ids.to_dtype(pipewright::candle_core::DType::I64)?;
    let batch = Batch::pair(ids, targets);
    let model = gpt(cfg)?;
    let dir = scratch.clone();
    let rows = local::run(1, |comm| {
        let mut v = Varuna::new(&model, Box::new(comm), opts.clone())?;
        v.set_optimizer(|ps| {
            Ok(Box::new(AdamW::new(ps, AdamWConfig::default())?) as Box<dyn Optimizer>)
        })?;
        v.step(&batch)?; // AdamW moments exist from here on
        let params = v.pipeline().total_params()?;
        let none = CheckpointOptions::default();
        let sync_root = dir.join("sync");
        let mut saved = PathBuf::new();
        let save = secs(|| {
            saved = v.checkpoint(&sync_root, &none)?;
            Ok(())
        })?;
        let bytes = Manifest::read(&saved)?.bytes() as usize;
        let plain = dir.join("plain.bin");
        let write = secs(|| plain_write(&plain, bytes))?;
        let load = secs(|| v.load_checkpoint(&saved).map(|_| ()))?;
        let read = secs(|| plain_read(&plain))?;
        // Background save: the stall is the call itself plus whatever finishing still waits
        // after some training steps.
        let async_root = dir.join("async");
        let start = secs(|| v.checkpoint_async(&async_root, &none))?;
        let mut trained = 0.0;
        for _ in 0..a.steps_during_async {
            trained += secs(|| v.step(&batch).map(|_| ()))?;
        }
        let finish = secs(|| v.finish_checkpoint().map(|_| ()))?;
        Ok((
            params, bytes, save, write, load, read, start, finish, trained,
        ))
    })?;
    let (params, bytes, save, write, load, read, start, finish, trained) = rows[0];
    let gb = bytes as f64 / 1e9;
    pipewright::say!(
        "checkpoint of a GPT with {params} parameters and AdamW state: {bytes} bytes of tensors"
    );
    pipewright::say!("{:<28} {:>10} {:>10} {:>8}", "", "seconds", "GB/s", "ratio");
    pipewright::say!(
        "{:<28} {save:>10.3} {:>10.3} {:>8.2}",
        "save (pipewright)",
        gb / save,
        write / save
    );
    pipewright::say!(
        "{:<28} {write:>10.3} {:>10.3} {:>8}",
        "plain sequential write+fsync",
        gb / write,
        "1"
    );
    pipewright::say!(
        "{:<28} {load:>10.3} {:>10.3} {:>8.2}",
        "load (pipewright)",
        gb / load,
        read / load
    );
    pipewright::say!(
        "{:<28} {read:>10.3} {:>10.3} {:>8}",
        "plain sequential read",
        gb / read,
        "1"
    );
    let stall = start + finish;
    pipewright::say!(
        "async save: {start:.3} s to snapshot and return, {finish:.3} s waiting at the end after {} steps ({trained:.1} s): stall {:.0} % of the synchronous save",
        a.steps_during_async,
        100.0 * stall / save
    );
    let _ = std::fs::remove_dir_all(&scratch);
    Ok(())
}
