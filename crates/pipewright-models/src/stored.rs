//! A reference model's checkpoints after the run: the run each came from
//! ([`RunSpec::of_checkpoint`]), written again for another layout ([`reshard`]), and exported
//! in Hugging Face's form ([`export_hf`]), each refusing what does not fit with a clear error.

use std::path::{Path, PathBuf};

use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::checkpoint::{CheckpointOptions, Reader};
use pipewright::engine::spec::TrainSpec;
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::precision::Precision;
use pipewright::trainer::model_spec::ModelSpec;
use pipewright::{invalid, Error, Result};

use crate::flags::{task_spec, TrainArgs};
use crate::moe::MoeNames;
use crate::run::META_KEY;
use crate::{hf, ModelConfig, RunSpec};

impl RunSpec {
    /// The run the checkpoint `r` came from, as `pipewright train` stored it: its spec, or
    /// for a checkpoint saved before runs were recorded so, the flags and the model config it
    /// stored.
    pub fn of_checkpoint(r: &Reader) -> Result<RunSpec> {
        let meta = &r.manifest().meta;
        if meta.get(META_KEY).is_some() || meta.get("args").is_none() {
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
}

/// Loads the checkpoint `r` at `layout` (ranks as threads, one micro-batch per replica) and
/// saves it again into the checkpoint directory `out`, which must be new (in another run's
/// checkpoints it would move that run's `latest` back). Returns the checkpoint written.
pub fn reshard(r: &Reader, layout: Layout, out: &Path) -> Result<PathBuf> {
    pipewright::runtime::files::ensure_new(out, "--out")?;
    if let Some((inside, what)) = pipewright::runtime::files::inside_other(out, true) {
        return Err(invalid!(
            "--out `{}` is inside `{}`, {what}: reshard into a directory of its own",
            out.display(),
            inside.display()
        ));
    }
    let spec = RunSpec::of_checkpoint(r)?;
    if let Some(d) = spec
        .model
        .tp_divides()
        .into_iter()
        .find(|d| d % layout.tp != 0)
    {
        return Err(invalid!(
            "--tp {} does not split this model ({}): its tensor-parallel size must divide {d}",
            layout.tp,
            match spec.model {
                ModelConfig::Gpt { .. } => "a GPT's heads and vocabulary",
                ModelConfig::Llama { .. } => "a Llama's heads, key/value heads, MLP and vocabulary",
                ModelConfig::Cnn { .. } => "the CNN has no tensor-parallel layers",
            }
        ));
    }
    let (model, tied) = (spec.model.build()?, spec.model.tied());
    // One micro-batch per replica; `Varuna::new` says so if the batch does not split.
    let opts = VarunaOptions {
        shared_weights: tied.clone(),
        ..VarunaOptions::of(TrainSpec {
            precision: r.manifest().precision.parse::<Precision>()?,
            seed: spec.train.seed,
            ..TrainSpec::new(
                layout,
                spec.train.batch.global_batch,
                spec.train.batch.global_batch / layout.dp,
                1,
            )
        })
    };
    let save = CheckpointOptions {
        meta: r.manifest().meta.clone(),
        extra: r.state()["extra"].clone(),
        ..Default::default()
    };
    let mut dirs = local::run(layout.world(), |comm| {
        let mut v = Varuna::new(&model, Box::new(comm), opts.clone())?;
        v.set_optimizer(|ps| spec.train.optimizer(ps, &tied))?;
        v.load_checkpoint(r.dir())?;
        v.checkpoint(out, &save)
    })?;
    Ok(dirs.swap_remove(0))
}

/// The Hugging Face architectures a checkpoint exports to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HfArch {
    /// `GPT2LMHeadModel`.
    Gpt2,
    /// `LlamaForCausalLM`.
    Llama,
    /// `MixtralForCausalLM`: a Llama whose blocks are mixtures of experts.
    Mixtral,
    /// `Qwen3MoeForCausalLM`: a Llama with per-head query/key norms and mixtures of experts.
    Qwen3Moe,
}

impl HfArch {
    /// The architecture's name in `config.json`.
    pub fn name(self) -> &'static str {
        match self {
            HfArch::Gpt2 => "GPT2LMHeadModel",
            HfArch::Llama => "LlamaForCausalLM",
            HfArch::Mixtral => "MixtralForCausalLM",
            HfArch::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }
}

/// `config.json` and `model.safetensors` of `arch` in `out`, in Hugging Face's names, the
/// vocabulary padding removed; a checkpoint of another model is refused, naming the format
/// that fits it. Returns the tensors written.
pub fn export_hf(r: &Reader, arch: HfArch, out: &Path) -> Result<usize> {
    let spec = RunSpec::of_checkpoint(r)?;
    let names = match &spec.model {
        ModelConfig::Llama { llama, .. } => llama.moe.map(|m| m.names),
        _ => None,
    };
    // A mixture neither Mixtral's form nor Qwen3-MoE's describes (shared experts, say) is
    // advised no Hugging Face format: each would refuse it.
    let no_hf_form = match &spec.model {
        ModelConfig::Llama { llama, .. } => llama
            .moe
            .is_some_and(|m| crate::hf_moe::hf_form(llama, &m).is_none()),
        _ => false,
    };
    let fits = match arch {
        HfArch::Llama => matches!(spec.model, ModelConfig::Llama { .. }) && names.is_none(),
        HfArch::Mixtral => names == Some(MoeNames::Mixtral),
        HfArch::Qwen3Moe => names == Some(MoeNames::Qwen3Moe),
        HfArch::Gpt2 => matches!(spec.model, ModelConfig::Gpt { .. }),
    };
    if !fits {
        let holds = match spec.model {
            ModelConfig::Llama { .. } if no_hf_form => {
                "a mixture of experts no Hugging Face format holds (shared experts, or mixtures \
                 that are neither Mixtral's nor Qwen3-MoE's): export it with --format safetensors"
            }
            ModelConfig::Gpt { .. } => "a GPT-2: export it with --format hf-gpt2",
            ModelConfig::Llama { .. } if names == Some(MoeNames::Qwen3Moe) => {
                "a Qwen3-MoE: export it with --format hf-qwen3-moe"
            }
            ModelConfig::Llama { .. } if names.is_some() => {
                "a mixture-of-experts Llama: export it with --format hf-mixtral"
            }
            ModelConfig::Llama { .. } => "a Llama: export it with --format hf-llama",
            ModelConfig::Cnn { .. } => {
                "a CNN, which no Hugging Face format holds: export it with --format safetensors"
            }
        };
        return Err(invalid!(
            "this format writes a {}, and the checkpoint holds {holds}",
            arch.name()
        ));
    }
    hf::export(r, &spec.model, out)
}
