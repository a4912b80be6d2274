//! `pipewright ckpt`: inspect, verify, reshard and export checkpoints.

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand, ValueEnum};
use pipewright::distributed::topology::Layout;
use pipewright::engine::checkpoint::{self, Reader};
use pipewright::{runtime::files, Result};
use pipewright_models::stored::{self, HfArch};

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
    /// `config.json` and `model.safetensors` that `MixtralForCausalLM.from_pretrained` loads
    /// (a Llama trained with `--n-experts`).
    #[value(name = "hf-mixtral")]
    HfMixtral,
    /// `config.json` and `model.safetensors` that `Qwen3MoeForCausalLM.from_pretrained` loads
    /// (a Qwen3-MoE fine-tuned with `--init-from`).
    #[value(name = "hf-qwen3-moe")]
    HfQwen3Moe,
}

#[derive(Args)]
pub struct ExportArgs {
    /// A checkpoint directory (`.../checkpoints/step-N`), or a checkpoints directory (its
    /// latest).
    pub dir: PathBuf,
    /// What to write: safetensors (every parameter whole), hf-gpt2, hf-llama, hf-mixtral or hf-qwen3-moe (a
    /// Hugging Face model directory).
    #[arg(long, value_enum)]
    pub format: ExportFormat,
    /// The file (safetensors) or directory (hf-gpt2, hf-llama, hf-mixtral, hf-qwen3-moe) to write.
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
                ExportFormat::HfGpt2
                | ExportFormat::HfLlama
                | ExportFormat::HfMixtral
                | ExportFormat::HfQwen3Moe => export_hf(&a.dir, a.format, &a.out),
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

/// Loads the checkpoint at the new layout (ranks as threads) and saves it again.
fn reshard(a: &ReshardArgs) -> Result<()> {
    let layout = Layout::new(a.pp, a.tp, a.dp)?;
    let dir = stored::reshard(&Reader::open(&a.dir)?, layout, &a.out)?;
    pipewright::say!("wrote {} for {layout}", dir.display());
    Ok(())
}

fn export_whole(dir: &Path, out: &Path) -> Result<()> {
    let n = Reader::open(dir)?.export_params(out, |n, t| Ok(Some((n.to_string(), t))), None)?;
    pipewright::say!("wrote {} ({n} parameters, whole)", out.display());
    Ok(())
}

/// `config.json` and `model.safetensors` in Hugging Face's names (GPT-2, Llama, Mixtral or Qwen3-MoE), the
/// vocabulary padding removed.
fn export_hf(dir: &Path, format: ExportFormat, out: &Path) -> Result<()> {
    let arch = match format {
        ExportFormat::HfLlama => HfArch::Llama,
        ExportFormat::HfMixtral => HfArch::Mixtral,
        ExportFormat::HfQwen3Moe => HfArch::Qwen3Moe,
        _ => HfArch::Gpt2,
    };
    let n = stored::export_hf(&Reader::open(dir)?, arch, out)?;
    pipewright::say!("wrote {} ({}, {n} tensors)", out.display(), arch.name());
    Ok(())
}
