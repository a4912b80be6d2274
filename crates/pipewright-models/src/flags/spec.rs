//! What the flags build: the task's spec, the layout, the rest of the run's [`TrainSpec`], and
//! the flags again as a command line or with a planned candidate's layout.

use std::path::{Path, PathBuf};

use pipewright::distributed::topology::Layout;
use pipewright::model::nn::optim::{
    AdamWConfig, LrSchedule, OptimSpec, OptimizerConfig, SgdConfig,
};
use pipewright::model::precision::Precision;
use pipewright::parallel::dims::ParallelSpec;
use pipewright::parallel::overlap::OverlapSpec;
use pipewright::parallel::pipeline::schedule::{Schedule, ScheduleKind};
use pipewright::parallel::pipeline::{PipelineSpec, Recompute};
use pipewright::parallel::zero::Zero;
use pipewright::plan::Candidate;
use pipewright::trainer::{Cadence, TrainSpec};
use pipewright::{invalid, Result};

use super::args::{DecayKind, LrScheduleKind, OptimizerKind, TaskKind, TrainArgs};
use crate::TaskSpec;

/// The data the flags name (the text file is read when the task is built).
pub fn task_spec(a: &TrainArgs) -> Result<TaskSpec> {
    if a.data.is_some() && !matches!(a.task, TaskKind::Text | TaskKind::Tokens) {
        return Err(invalid!(
            "--data is only read by --task text and --task tokens"
        ));
    }
    Ok(match a.task {
        TaskKind::Adder => TaskSpec::Adder { digits: a.digits },
        TaskKind::Sort => TaskSpec::Sort { len: 6, symbols: 3 },
        TaskKind::Shapes => TaskSpec::Shapes {
            image_size: a.image_size,
        },
        TaskKind::Tokens => {
            let data = a.data.clone().ok_or_else(|| {
                invalid!("--task tokens needs --data DIR (token shards: `pipewright data prepare`)")
            })?;
            let blend = blend_of(&data)?;
            let dir = blend.first().map_or(data, |(_, d)| d.clone());
            // Opening the blend checks every dataset and that they share a tokenizer.
            let parts = match blend.is_empty() {
                true => vec![(1.0, dir.clone())],
                false => blend.clone(),
            };
            let opened = pipewright::data::Blend::open(&parts)?;
            TaskSpec::Tokens {
                tokenizer_sha256: opened.first().index().tokenizer_sha256.clone(),
                dir,
                seq_len: seq_len(a)?,
                blend,
            }
        }
        TaskKind::Text => TaskSpec::Text {
            path: a
                .data
                .clone()
                .ok_or_else(|| invalid!("--task text needs --data FILE (any text file)"))?,
            seq_len: seq_len(a)?,
        },
    })
}

/// The datasets of a blend written `0.7:DIR_A,0.3:DIR_B` (each part a weight, a colon and a
/// shard directory); empty for a single directory. How `--data` reads a blend, wherever it
/// is given (`train`, `data windows`).
pub fn blend_of(data: &Path) -> Result<Vec<(f64, PathBuf)>> {
    let text = data.to_string_lossy();
    let parts: Vec<Option<(f64, PathBuf)>> = text
        .split(',')
        .map(|p| {
            let (w, d) = p.split_once(':')?;
            Some((w.trim().parse::<f64>().ok()?, PathBuf::from(d.trim())))
        })
        .collect();
    if parts.iter().all(Option::is_none) && !text.contains(',') {
        return Ok(Vec::new());
    }
    parts
        .into_iter()
        .zip(text.split(','))
        .map(|(p, raw)| {
            p.ok_or_else(|| {
                invalid!(
                    "`{raw}` in --data `{text}` is not WEIGHT:DIR: write a blend as \
                     0.7:DIR_A,0.3:DIR_B"
                )
            })
        })
        .collect()
}

/// The tokens of a training window: `--block-size`; else a pretrained model's positions
/// (`--init-from`: its `config.json`), as PyTorch trains such a model on windows of its
/// context; else 64. (A pretrained model trained on the default 64 was evaluated on windows
/// of 64 too, which a run of its own length in PyTorch beat by 25 % in perplexity.)
fn seq_len(a: &TrainArgs) -> Result<usize> {
    if let Some(b) = a.block_size {
        return Ok(b);
    }
    let Some(dir) = &a.init_from else {
        return Ok(64);
    };
    Ok(match crate::hf::config_from_dir(dir)? {
        crate::ModelConfig::Gpt { gpt, .. } => gpt.block_size,
        crate::ModelConfig::Llama { llama, .. } => llama.block_size,
        crate::ModelConfig::Cnn { .. } => 64,
    })
}

impl TrainArgs {
    /// The layout the flags ask for (`--pp --tp --cp --dp --ep`).
    pub fn layout(&self) -> Result<Layout> {
        Layout::new(self.pp, self.tp, self.dp)?
            .with_cp(self.cp)?
            .with_ep(self.ep)
    }

    /// Ranks the flags ask for.
    pub fn world(&self) -> usize {
        // Saturating: a layout of absurd degrees is refused by its check, not wrapped.
        [self.pp, self.tp, self.cp, self.dp]
            .iter()
            .fold(1usize, |w, d| w.saturating_mul(*d))
    }

    /// Everything the flags say about training, besides the model and the data.
    pub fn train_spec(&self) -> Result<TrainSpec> {
        if self.clip < 0.0 || !self.clip.is_finite() {
            return Err(invalid!("--clip must be >= 0 (0 turns clipping off)"));
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return Err(invalid!("--min-lr-ratio must lie in [0, 1]"));
        }
        let optimizer = match self.optimizer {
            OptimizerKind::Adamw => OptimizerConfig::AdamW(AdamWConfig {
                beta1: self.beta1,
                beta2: self.beta2,
                eps: self.eps,
                weight_decay: self.weight_decay,
                decay_embeddings: self.decay == DecayKind::MatricesAndEmbeddings,
            }),
            OptimizerKind::Sgd => OptimizerConfig::Sgd(SgdConfig {
                momentum: self.momentum,
                weight_decay: self.weight_decay,
                ..Default::default()
            }),
        };
        let lr = match self.lr_decay {
            LrScheduleKind::Constant => LrSchedule::Constant { lr: self.lr },
            LrScheduleKind::Cosine => LrSchedule::WarmupCosine {
                lr: self.lr,
                warmup: self.warmup.min(self.steps),
                total: self.steps,
                min_lr: self.lr * self.min_lr_ratio,
            },
        };
        Ok(TrainSpec {
            parallel: ParallelSpec {
                layout: self.layout()?,
                zero: self.zero.parse::<Zero>()?,
                sequence_parallel: self.sequence_parallel,
            },
            global_batch: self.batch_size,
            micro_batch: self.micro_batch()?,
            pipeline: PipelineSpec {
                schedule: self.schedule.parse::<ScheduleKind>()?,
                virtual_stages: self.virtual_stages,
                custom_schedule: self
                    .schedule_file
                    .as_deref()
                    .map(Schedule::load)
                    .transpose()?,
                recompute: self.recompute.parse::<Recompute>()?,
                balance: self.balance.as_deref().map(str::parse).transpose()?,
                deferred_batch_norm: self.deferred_batch_norm,
            },
            precision: self.precision.parse::<Precision>()?,
            optim: OptimSpec {
                optimizer,
                lr,
                clip: (self.clip > 0.0).then_some(self.clip),
            },
            overlap: OverlapSpec {
                overlap: !self.no_overlap,
                bucket_bytes: (self.bucket_mb * (1 << 20) as f64).round().max(1.0) as usize,
                zero_live_layers: self.zero_live_layers,
            },
            seed: self.seed,
            cadence: Cadence {
                steps: self.steps,
                eval_every: self.eval_every,
                checkpoint_every: self.checkpoint_every,
                log_every: self.log_every,
                async_checkpoint: self.async_checkpoint,
            },
        })
    }

    /// Fails on flags that `profile` cannot take: it times the model's layers with all their
    /// experts, whatever the layout, so `--ep` is refused by name (a layout's check asked for
    /// a divisor of `--dp`, which `profile` does not take).
    pub fn check_profiled(&self) -> Result<()> {
        if self.ep != 1 {
            return Err(invalid!(
                "profile times the model's layers with all their experts, whatever the layout: \
                 drop --ep (`plan` searches expert parallelism from the profile)"
            ));
        }
        Ok(())
    }

    /// Rows of one micro-batch: `--chunk-size`, or the batch split over `--dp` replicas of
    /// `--chunks` micro-batches each.
    pub fn micro_batch(&self) -> Result<usize> {
        if let Some(s) = self.chunk_size {
            return Ok(s);
        }
        let per = self.dp * self.chunks;
        if !self.batch_size.is_multiple_of(per) {
            return Err(invalid!(
                "--batch-size {} does not split into --dp {} replicas of --chunks {} equal \
                 micro-batches: choose a batch size that is a multiple of {per}",
                self.batch_size,
                self.dp,
                self.chunks
            ));
        }
        Ok(self.batch_size / per)
    }

    /// The flags as a command line: every flag with its value, by clap's own names (what
    /// parses back to the same flags; `plan --measure` trains each candidate with it).
    pub fn argv(&self) -> Result<Vec<String>> {
        let values = serde_json::to_value(self).map_err(|e| invalid!("{e}"))?;
        let cmd = <Self as clap::Args>::augment_args(clap::Command::new("train"));
        let mut argv = Vec::new();
        for arg in cmd.get_arguments() {
            let (Some(long), Some(v)) = (arg.get_long(), values.get(arg.get_id().as_str())) else {
                continue;
            };
            match v {
                serde_json::Value::Null | serde_json::Value::Bool(false) => {}
                serde_json::Value::Bool(true) => argv.push(format!("--{long}")),
                serde_json::Value::String(s) => argv.extend([format!("--{long}"), s.clone()]),
                other => argv.extend([format!("--{long}"), other.to_string()]),
            }
        }
        Ok(argv)
    }

    /// These flags with the planner's candidate `c` (its layout, micro-batches, schedule,
    /// recompute, ZeRO and sequence parallelism) and its layers per stage, `balance`.
    pub fn for_candidate(&self, c: &Candidate, balance: &[usize]) -> Self {
        let mut a = self.clone();
        (a.pp, a.tp, a.dp, a.cp) = (
            c.parallel.layout.pp,
            c.parallel.layout.tp,
            c.parallel.layout.dp,
            c.parallel.layout.cp,
        );
        a.ep = c.parallel.layout.ep;
        a.sequence_parallel = c.parallel.sequence_parallel;
        a.chunks = c.micro_batches;
        a.chunk_size = None;
        a.schedule = c.schedule.to_string();
        a.schedule_file = None;
        a.virtual_stages = c.virtual_stages;
        a.recompute = c.recompute.to_string();
        a.zero = c.parallel.zero.to_string();
        let list: Vec<String> = balance.iter().map(usize::to_string).collect();
        a.balance = Some(list.join(","));
        a
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Wrapper {
        #[command(flatten)]
        a: TrainArgs,
    }

    #[test]
    fn the_command_line_parses_back_to_the_same_flags() {
        let mut w = Wrapper::parse_from([
            "x",
            "--pp",
            "2",
            "--virtual",
            "2",
            "--schedule",
            "interleaved",
            "--lr-schedule",
            "constant",
            "--async-checkpoint",
            "--balance",
            "1,3",
            "--lr",
            "0.003",
        ]);
        w.a.recompute = "always".into();
        let argv = w.a.argv().unwrap();
        let back = Wrapper::parse_from(std::iter::once("x".to_string()).chain(argv));
        assert_eq!(
            serde_json::to_value(&back.a).unwrap(),
            serde_json::to_value(&w.a).unwrap()
        );
    }
}
