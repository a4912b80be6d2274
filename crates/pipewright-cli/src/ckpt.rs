//! `pipewright ckpt`: inspect, verify, reshard and export checkpoints.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand, ValueEnum};
use pipewright::checkpoint::format::{f32_data, write_safetensors_with, Blob};
use pipewright::checkpoint::{self, CheckpointOptions, EntryKind, Reader};
use pipewright::comm::local;
use pipewright::precision::Precision;
use pipewright::topology::Layout;
use pipewright::varuna::{Varuna, VarunaOptions};
use pipewright::{invalid, Error, Result};

use crate::train::{make_optimizer, ModelConfig, TrainArgs};

#[derive(Subcommand)]
pub enum CkptCommand {
    /// One table: every tensor's name, whole shape, dtype, parts and bytes; the layout and step.
    Inspect { dir: PathBuf },
    /// Checks every file's and every tensor part's checksum, and that every tensor is complete.
    Verify { dir: PathBuf },
    /// Writes the checkpoint again for another layout (loaded and saved by ranks as threads).
    Reshard(ReshardArgs),
    /// Whole tensors by global name, or a Hugging Face GPT-2 directory.
    Export(ExportArgs),
}

#[derive(Args)]
pub struct ReshardArgs {
    pub dir: PathBuf,
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    #[arg(long, default_value_t = 1)]
    pub dp: usize,
    /// The checkpoint directory to write (its `step-NNNNNNNN` and `latest`).
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum ExportFormat {
    /// One safetensors file of every parameter, whole, by global name.
    Safetensors,
    /// `config.json` and `model.safetensors` that `GPT2LMHeadModel.from_pretrained` loads.
    #[value(name = "hf-gpt2")]
    HfGpt2,
}

#[derive(Args)]
pub struct ExportArgs {
    pub dir: PathBuf,
    #[arg(long, value_enum)]
    pub format: ExportFormat,
    /// The file (safetensors) or directory (hf-gpt2) to write.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(c: CkptCommand) -> Result<()> {
    match c {
        CkptCommand::Inspect { dir } => inspect(&dir),
        CkptCommand::Verify { dir } => {
            let v = checkpoint::verify(&dir)?;
            println!(
                "ok: {} ({} files, {} tensors, {} bytes of tensor data; every checksum matches)",
                v.dir.display(),
                v.files,
                v.tensors,
                v.bytes
            );
            Ok(())
        }
        CkptCommand::Reshard(a) => reshard(&a),
        CkptCommand::Export(a) => match a.format {
            ExportFormat::Safetensors => export_whole(&a.dir, &a.out),
            ExportFormat::HfGpt2 => export_hf_gpt2(&a.dir, &a.out),
        },
    }
}

fn inspect(dir: &Path) -> Result<()> {
    let r = Reader::open(dir)?;
    let m = r.manifest();
    println!(
        "{}: step {}, saved at {} {} by {} ranks, {} tensors, {} bytes",
        r.dir().display(),
        m.step,
        m.layout,
        m.precision,
        m.world,
        m.tensors.len(),
        m.bytes()
    );
    println!(
        "{:<44} {:<16} {:<6} {:<10} {:>5} {:>12}",
        "name", "shape", "dtype", "kind", "parts", "bytes"
    );
    for (n, e) in &m.tensors {
        let bytes: u64 = e.parts.iter().map(|p| p.end - p.begin).sum();
        let kind = format!("{:?}", e.kind).to_lowercase();
        let shape = format!("{:?}", e.shape);
        println!(
            "{n:<44} {shape:<16} {:<6} {kind:<10} {:>5} {bytes:>12}",
            e.dtype,
            e.parts.len()
        );
    }
    Ok(())
}

/// The run a checkpoint came from, as `pipewright train` stored it.
fn stored_run(r: &Reader) -> Result<(TrainArgs, ModelConfig)> {
    let meta = &r.manifest().meta;
    let err = |what: &str, e: serde_json::Error| {
        Error::State(format!(
            "`{}` was not saved by `pipewright train` (its manifest's meta has no {what}: {e})",
            r.dir().display()
        ))
    };
    let args = serde_json::from_value(meta["args"].clone()).map_err(|e| err("args", e))?;
    let model = serde_json::from_value(meta["model"].clone()).map_err(|e| err("model", e))?;
    Ok((args, model))
}

/// Loads the checkpoint at the new layout (ranks as threads) and saves it again.
fn reshard(a: &ReshardArgs) -> Result<()> {
    let r = Reader::open(&a.dir)?;
    let (args, model_config) = stored_run(&r)?;
    let (model, tied) = model_config.build()?;
    let layout = Layout::new(a.pp, a.tp, a.dp)?;
    // One micro-batch per replica; `Varuna::new` says so if the batch does not split.
    let opts = VarunaOptions {
        shared_weights: tied,
        precision: r.manifest().precision.parse::<Precision>()?,
        seed: args.seed,
        ..VarunaOptions::new(layout, args.batch_size, args.batch_size / a.dp)
    };
    let save = CheckpointOptions {
        meta: r.manifest().meta.clone(),
        extra: r.state()["extra"].clone(),
        ..Default::default()
    };
    let dirs = local::run(layout.world(), |comm| {
        let mut v = Varuna::new(&model, Box::new(comm), opts.clone())?;
        v.set_optimizer(|ps| make_optimizer(&args, ps))?;
        v.load_checkpoint(r.dir())?;
        v.checkpoint(&a.out, &save)
    })?;
    println!("wrote {} for {layout}", dirs[0].display());
    Ok(())
}

/// A tensor to export: name, shape, values.
type Owned = (String, Vec<usize>, Vec<f32>);

/// Every parameter, whole, into `path` (atomically).
fn write_params(path: &Path, owned: &[Owned], metadata: Option<serde_json::Value>) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let blobs: Vec<Blob> = owned
        .iter()
        .map(|(n, s, d)| (n.as_str(), s.as_slice(), d.as_slice()))
        .collect();
    write_safetensors_with(&tmp, &blobs, metadata)?;
    std::fs::rename(&tmp, path).map_err(|e| Error::io("cannot rename into", path, e))?;
    Ok(())
}

fn export_whole(dir: &Path, out: &Path) -> Result<()> {
    let r = Reader::open(dir)?;
    let mut blobs = Vec::new();
    for (n, e) in &r.manifest().tensors {
        if e.kind == EntryKind::Param {
            let t = r.read_whole(n)?;
            blobs.push((n.clone(), t.dims().to_vec(), f32_data(&t)?));
        }
    }
    write_params(out, &blobs, None)?;
    println!(
        "wrote {} ({} parameters, whole)",
        out.display(),
        blobs.len()
    );
    Ok(())
}

/// `config.json` and `model.safetensors` in Hugging Face GPT-2's names, the vocabulary padding
/// removed.
fn export_hf_gpt2(dir: &Path, out: &Path) -> Result<()> {
    let r = Reader::open(dir)?;
    let (args, model) = stored_run(&r)?;
    let ModelConfig::Gpt { gpt: cfg, vocab } = model else {
        return Err(invalid!(
            "--format hf-gpt2 exports a GPT; this checkpoint holds a {:?}",
            args.model
        ));
    };
    std::fs::create_dir_all(out).map_err(|e| Error::io("cannot create", out, e))?;
    let mut blobs = Vec::new();
    for (n, e) in &r.manifest().tensors {
        if e.kind != EntryKind::Param {
            continue;
        }
        let mut t = r.read_whole(n)?;
        if n == "wte.weight" || n == "lm_head.weight" {
            t = t.narrow(0, 0, vocab)?;
        }
        let name = if n == "lm_head.weight" {
            n.clone()
        } else {
            format!("transformer.{n}")
        };
        blobs.push((name, t.dims().to_vec(), f32_data(&t)?));
    }
    write_params(
        &out.join("model.safetensors"),
        &blobs,
        Some(serde_json::json!({"format": "pt"})),
    )?;
    let config = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": null,
        "activation_function": "gelu_new",
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": true,
        "bos_token_id": null,
        "eos_token_id": null,
        "torch_dtype": "float32",
    });
    let text = serde_json::to_string_pretty(&config).map_err(|e| invalid!("{e}"))?;
    let cp = out.join("config.json");
    std::fs::write(&cp, text).map_err(|e| Error::io("cannot write", &cp, e))?;
    println!(
        "wrote {} (GPT2LMHeadModel, {} tensors)",
        out.display(),
        blobs.len()
    );
    Ok(())
}
