//! What the flags build: the task's spec, the layout, the rest of the run's [`TrainSpec`], and
//! the flags again as a command line or with a planned candidate's layout.

use std::path::{Path, PathBuf};

use pipewright::distributed::topology::Layout;
use pipewright::model::nn::optim::{
    AdamWConfig, LrSchedule, OptimSpec, OptimizerConfig, SgdConfig,
};
use pipewright::parallel::dims::{BatchSpec, ParallelSpec};
use pipewright::parallel::overlap::OverlapSpec;
use pipewright::parallel::pipeline::schedule::Schedule;
use pipewright::parallel::pipeline::{Balance, PipelineSpec};
use pipewright::plan::Candidate;
use pipewright::trainer::TrainSpec;
use pipewright::{invalid, Result};

use super::args::{DecayKind, LrScheduleKind, OptimizerKind, TaskKind, TrainArgs};
use super::sections::{OptimArgs, ParallelArgs};
use crate::TaskSpec;

/// The data the flags name (the text file is read when the task is built).
pub fn task_spec(a: &TrainArgs) -> Result<TaskSpec> {
    if a.inputs.data.is_some() && !matches!(a.task, TaskKind::Text | TaskKind::Tokens) {
        return Err(invalid!(
            "--data is only read by --task text and --task tokens"
        ));
    }
    Ok(match a.task {
        TaskKind::Adder => TaskSpec::Adder {
            digits: a.inputs.digits,
        },
        TaskKind::Sort => TaskSpec::Sort { len: 6, symbols: 3 },
        TaskKind::Shapes => TaskSpec::Shapes {
            image_size: a.inputs.image_size,
        },
        TaskKind::Tokens => {
            let data = a.inputs.data.clone().ok_or_else(|| {
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
                .inputs
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
    if let Some(b) = a.sizes.block_size {
        return Ok(b);
    }
    let Some(dir) = &a.sizes.init_from else {
        return Ok(64);
    };
    Ok(match crate::hf::config_from_dir(dir)? {
        crate::ModelConfig::Gpt { gpt, .. } => gpt.block_size,
        crate::ModelConfig::Llama { llama, .. } => llama.block_size,
        crate::ModelConfig::Cnn { .. } => 64,
    })
}

impl TrainArgs {
    /// The layout the flags ask for (`--pp --tp --cp --dp --ep`), checked.
    pub fn layout(&self) -> Result<Layout> {
        self.parallel.layout.validated()
    }

    /// Ranks the flags ask for.
    pub fn world(&self) -> usize {
        self.parallel.layout.world()
    }

    /// Everything the flags say about training, besides the model and the data: each
    /// section's flags build the library's section of the same name.
    pub fn train_spec(&self) -> Result<TrainSpec> {
        Ok(TrainSpec {
            parallel: ParallelSpec {
                layout: self.layout()?,
                zero: self.parallel.zero,
                sequence_parallel: self.parallel.sequence_parallel,
            },
            batch: BatchSpec {
                global_batch: self.batch.batch_size,
                micro_batch: self.micro_batch()?,
            },
            pipeline: self.pipeline_spec()?,
            precision: self.precision,
            optim: self.optim.spec(self.cadence.steps)?,
            overlap: self.parallel.overlap(),
            seed: self.seed,
            cadence: self.cadence,
        })
    }

    /// Fails on flags that `profile` cannot take: it times the model's layers with all their
    /// experts, whatever the layout, so `--ep` is refused by name (a layout's check asked for
    /// a divisor of `--dp`, which `profile` does not take).
    pub fn check_profiled(&self) -> Result<()> {
        if self.parallel.layout.ep != 1 {
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
        if let Some(s) = self.batch.chunk_size {
            return Ok(s);
        }
        let per = self.parallel.layout.dp * self.batch.chunks;
        if !self.batch.batch_size.is_multiple_of(per) {
            return Err(invalid!(
                "--batch-size {} does not split into --dp {} replicas of --chunks {} equal \
                 micro-batches: choose a batch size that is a multiple of {per}",
                self.batch.batch_size,
                self.parallel.layout.dp,
                self.batch.chunks
            ));
        }
        Ok(self.batch.batch_size / per)
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
        let p = &mut a.parallel;
        p.layout = c.parallel.layout;
        (p.zero, p.sequence_parallel) = (c.parallel.zero, c.parallel.sequence_parallel);
        (a.batch.chunks, a.batch.chunk_size) = (c.micro_batches, None);
        a.pipeline = PipelineSpec {
            schedule: c.schedule,
            custom_schedule: None,
            balance: Some(Balance::Layers(balance.to_vec())),
            ..a.pipeline
        };
        a.schedule_file = None;
        a
    }
}

impl ParallelArgs {
    /// What `--no-overlap`, `--bucket-mb` and `--zero-live-layers` say.
    pub fn overlap(&self) -> OverlapSpec {
        OverlapSpec {
            overlap: !self.no_overlap,
            bucket_bytes: (self.bucket_mb * (1 << 20) as f64).round().max(1.0) as usize,
            zero_live_layers: self.zero_live_layers,
        }
    }
}

impl TrainArgs {
    /// The pipeline section: the flags' schedule, with a `--schedule-file` read and parsed.
    pub fn pipeline_spec(&self) -> Result<PipelineSpec> {
        Ok(PipelineSpec {
            custom_schedule: self
                .schedule_file
                .as_deref()
                .map(Schedule::load)
                .transpose()?,
            ..self.pipeline.clone()
        })
    }
}

impl OptimArgs {
    /// The optimizer section for a run of `steps` steps (the cosine schedule's length).
    pub fn spec(&self, steps: u64) -> Result<OptimSpec> {
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
                warmup: self.warmup.min(steps),
                total: steps,
                min_lr: self.lr * self.min_lr_ratio,
            },
        };
        Ok(OptimSpec {
            optimizer,
            lr,
            clip: (self.clip > 0.0).then_some(self.clip),
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;
    use pipewright::parallel::pipeline::Recompute;

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
        w.a.pipeline.schedule.recompute = Recompute::Always;
        let argv = w.a.argv().unwrap();
        let back = Wrapper::parse_from(std::iter::once("x".to_string()).chain(argv));
        assert_eq!(
            serde_json::to_value(&back.a).unwrap(),
            serde_json::to_value(&w.a).unwrap()
        );
    }

    #[test]
    fn flags_recorded_as_text_read_back_typed() {
        let mut v = serde_json::to_value(Wrapper::parse_from(["x"]).a).unwrap();
        assert_eq!(v["zero"], "0");
        assert_eq!(v["balance"], serde_json::Value::Null);
        v["zero"] = "2".into();
        v["balance"] = "3,2".into();
        v["recompute"] = "except_last".into();
        // A run with a schedule file recorded `file PATH` as its schedule before the file had
        // a field of its own.
        v["schedule"] = "file /runs/edited.csv".into();
        let a: TrainArgs = serde_json::from_value(v).unwrap();
        assert_eq!(a.parallel.zero, pipewright::parallel::zero::Zero::Gradients);
        assert_eq!(a.pipeline.balance, Some(Balance::Layers(vec![3, 2])));
        assert_eq!(a.pipeline.schedule.recompute, Recompute::ExceptLast);
        assert_eq!(
            a.pipeline.schedule.kind,
            pipewright::parallel::pipeline::schedule::ScheduleKind::OneFOneB
        );
    }
}
