//! `pipewright ckpt`: inspect, verify, reshard and export checkpoints.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand, ValueEnum};
use pipewright::checkpoint::{self, CheckpointOptions, Reader};
use pipewright::comm::local;
use pipewright::precision::Precision;
use pipewright::topology::Layout;
use pipewright::varuna::{Varuna, VarunaOptions};
use pipewright::ModelSpec;
use pipewright::{files, invalid, Error, Result};

use pipewright_models::{hf, run, ModelConfig, RunSpec};

use crate::train::{task_spec, TrainArgs};

#[derive(Subcommand)]
pub enum CkptCommand {
    /// One table: every tensor's name, whole shape, dtype, parts and bytes; the layout and step.
    Inspect {
        /// A checkpoint directory (`.../checkpoints/step-N`), or a checkpoints directory
        /// (its latest).
        dir: PathBuf,
    },
    /// Checks every file's and every tensor part's checksum, and that every tensor is complete.
    Verify {
        /// A checkpoint directory (`.../checkpoints/step-N`), or a checkpoints directory
        /// (its latest).
        dir: PathBuf,
    },
    /// Writes the checkpoint again for another layout (loaded and saved by ranks as threads).
    Reshard(ReshardArgs),
    /// Whole tensors by global name, or a Hugging Face GPT-2 directory.
    Export(ExportArgs),
}

#[derive(Args)]
pub struct ReshardArgs {
    /// A checkpoint directory (`.../checkpoints/step-N`), or a checkpoints directory (its
    /// latest).
    pub dir: PathBuf,
    /// Pipeline stages of the layout to write.
    #[arg(long, default_value_t = 1)]
    pub pp: usize,
    /// Tensor-parallel ranks of the layout to write.
    #[arg(long, default_value_t = 1)]
    pub tp: usize,
    /// Data-parallel replicas of the layout to write.
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
    /// `config.json` and `model.safetensors` that `LlamaForCausalLM.from_pretrained` loads.
    #[value(name = "hf-llama")]
    HfLlama,
}

#[derive(Args)]
pub struct ExportArgs {
    /// A checkpoint directory (`.../checkpoints/step-N`), or a checkpoints directory (its
    /// latest).
    pub dir: PathBuf,
    /// What to write: safetensors (every parameter whole), hf-gpt2 or hf-llama (a
    /// Hugging Face model directory).
    #[arg(long, value_enum)]
    pub format: ExportFormat,
    /// The file (safetensors) or directory (hf-gpt2, hf-llama) to write.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn run(c: CkptCommand) -> Result<()> {
    match c {
        CkptCommand::Inspect { dir } => inspect(&dir),
        CkptCommand::Verify { dir } => {
            let v = checkpoint::verify(&dir)?;
            pipewright::say!(
                "ok: {} ({} files, {} tensors, {} bytes of tensor data; every checksum matches)",
                v.dir.display(),
                v.files,
                v.tensors,
                v.bytes
            );
            Ok(())
        }
        CkptCommand::Reshard(a) => reshard(&a),
        CkptCommand::Export(a) => {
            // Never over an existing file or directory (a live checkpoint's part included).
            files::ensure_new(&a.out, "--out")?;
            match a.format {
                ExportFormat::Safetensors => export_whole(&a.dir, &a.out),
                ExportFormat::HfGpt2 | ExportFormat::HfLlama => export_hf(&a.dir, a.format, &a.out),
            }
        }
    }
}

fn inspect(dir: &Path) -> Result<()> {
    let r = Reader::open(dir)?;
    let m = r.manifest();
    pipewright::say!(
        "{}: step {}, saved at {} {} by {} ranks, {} tensors, {} bytes",
        r.dir().display(),
        m.step,
        m.layout,
        m.precision,
        m.world,
        m.tensors.len(),
        m.bytes()
    );
    pipewright::say!(
        "{:<44} {:<16} {:<6} {:<10} {:>5} {:>12}",
        "name",
        "shape",
        "dtype",
        "kind",
        "parts",
        "bytes"
    );
    for (n, e) in &m.tensors {
        let bytes: u64 = e.parts.iter().map(|p| p.end - p.begin).sum();
        let kind = format!("{:?}", e.kind).to_lowercase();
        let shape = format!("{:?}", e.shape);
        pipewright::say!(
            "{n:<44} {shape:<16} {:<6} {kind:<10} {:>5} {bytes:>12}",
            e.dtype,
            e.parts.len()
        );
    }
    Ok(())
}

/// The run a checkpoint came from, as `pipewright train` stored it: its [`RunSpec`], or for a
/// checkpoint saved before runs were recorded so, the flags and the model config it stored.
pub(crate) fn stored_run(r: &Reader) -> Result<RunSpec> {
    let meta = &r.manifest().meta;
    if meta.get(run::META_KEY).is_some() || meta.get("args").is_none() {
        return RunSpec::from_meta(meta);
    }
    let err = |what: &str, e: serde_json::Error| {
        Error::State(format!(
            "`{}` was not saved by `pipewright train` (its manifest's meta has no {what}: {e})",
            r.dir().display()
        ))
    };
    let args: TrainArgs =
        serde_json::from_value(meta["args"].clone()).map_err(|e| err("args", e))?;
    let model = serde_json::from_value(meta["model"].clone()).map_err(|e| err("model", e))?;
    Ok(RunSpec {
        model,
        task: task_spec(&args)?,
        train: args.train_spec()?,
    })
}

/// Loads the checkpoint at the new layout (ranks as threads) and saves it again.
fn reshard(a: &ReshardArgs) -> Result<()> {
    // Into another run's checkpoints it would move that run's `latest` back.
    files::ensure_new(&a.out, "--out")?;
    if let Some((inside, what)) = files::inside_other(&a.out, true) {
        return Err(invalid!(
            "--out `{}` is inside `{}`, {what}: reshard into a directory of its own",
            a.out.display(),
            inside.display()
        ));
    }
    let r = Reader::open(&a.dir)?;
    let spec = stored_run(&r)?;
    if let Some(d) = spec.model.tp_divides().into_iter().find(|d| d % a.tp != 0) {
        return Err(invalid!(
            "--tp {} does not split this model ({}): its tensor-parallel size must divide {d}",
            a.tp,
            match spec.model {
                ModelConfig::Gpt { .. } => "a GPT's heads and vocabulary",
                ModelConfig::Llama { .. } => "a Llama's heads, key/value heads, MLP and vocabulary",
                ModelConfig::Cnn { .. } => "the CNN has no tensor-parallel layers",
            }
        ));
    }
    let (model, tied) = (spec.model.build()?, spec.model.tied());
    let layout = Layout::new(a.pp, a.tp, a.dp)?;
    // One micro-batch per replica; `Varuna::new` says so if the batch does not split.
    let opts = VarunaOptions {
        shared_weights: tied.clone(),
        precision: r.manifest().precision.parse::<Precision>()?,
        seed: spec.train.seed,
        ..VarunaOptions::new(
            layout,
            spec.train.global_batch,
            spec.train.global_batch / a.dp,
        )
    };
    let save = CheckpointOptions {
        meta: r.manifest().meta.clone(),
        extra: r.state()["extra"].clone(),
        ..Default::default()
    };
    let dirs = local::run(layout.world(), |comm| {
        let mut v = Varuna::new(&model, Box::new(comm), opts.clone())?;
        v.set_optimizer(|ps| spec.train.optimizer(ps, &tied))?;
        v.load_checkpoint(r.dir())?;
        v.checkpoint(&a.out, &save)
    })?;
    pipewright::say!("wrote {} for {layout}", dirs[0].display());
    Ok(())
}

fn export_whole(dir: &Path, out: &Path) -> Result<()> {
    let n = Reader::open(dir)?.export_params(out, |n, t| Ok(Some((n.to_string(), t))), None)?;
    pipewright::say!("wrote {} ({n} parameters, whole)", out.display());
    Ok(())
}

/// `config.json` and `model.safetensors` in Hugging Face's names (GPT-2 or Llama), the
/// vocabulary padding removed.
fn export_hf(dir: &Path, format: ExportFormat, out: &Path) -> Result<()> {
    let r = Reader::open(dir)?;
    let spec = stored_run(&r)?;
    let (arch, fits) = match format {
        ExportFormat::HfLlama => (
            "LlamaForCausalLM",
            matches!(spec.model, ModelConfig::Llama { .. }),
        ),
        _ => (
            "GPT2LMHeadModel",
            matches!(spec.model, ModelConfig::Gpt { .. }),
        ),
    };
    if !fits {
        let holds = match spec.model {
            ModelConfig::Gpt { .. } => "a GPT-2: export it with --format hf-gpt2",
            ModelConfig::Llama { .. } => "a Llama: export it with --format hf-llama",
            ModelConfig::Cnn { .. } => {
                "a CNN, which no Hugging Face format holds: export it with --format safetensors"
            }
        };
        return Err(invalid!(
            "this format writes a {arch}, and the checkpoint holds {holds}"
        ));
    }
    let n = hf::export(&r, &spec.model, out)?;
    pipewright::say!("wrote {} ({arch}, {n} tensors)", out.display());
    Ok(())
}
