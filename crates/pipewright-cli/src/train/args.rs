//! The flags of `pipewright train` and what they build: the task, the model, the optimizer and
//! the learning-rate schedule.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use pipewright::nn::optim::{AdamW, AdamWConfig, LrSchedule, Optimizer, Sgd, SgdConfig};
use pipewright::plan::{Hardware, Profile};
use pipewright::{invalid, Result, Sequential};
use pipewright_models::tasks::{Adder, Shapes, Sort, Text};
use pipewright_models::{cnn, gpt, CnnConfig, GptConfig, Task, TaskShape, TIED};
use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    Gpt,
    Cnn,
}

#[derive(Clone, Copy, Debug, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskKind {
    Adder,
    Sort,
    Text,
    Shapes,
}

#[derive(Clone, Copy, Debug, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    Adamw,
    Sgd,
}

#[derive(Clone, Copy, Debug, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrScheduleKind {
    Constant,
    Cosine,
}

/// Every flag of a run; written to `params.json`.
#[derive(Args, Clone, Debug, Serialize, Deserialize)]
pub struct TrainArgs {
    #[arg(long, value_enum, default_value = "gpt")]
    pub model: ModelKind,
    #[arg(long, value_enum, default_value = "adder")]
    pub task: TaskKind,
    /// Text file for `--task text`.
    #[arg(long)]
    pub data: Option<PathBuf>,
    #[arg(long, default_value_t = 1000, value_parser = positive_u64)]
    pub steps: u64,
    /// Rows of every step, over all data-parallel replicas.
    #[arg(long, default_value_t = 64, value_parser = positive)]
    pub batch_size: usize,
    /// Micro-batches each data-parallel replica splits its rows into (torchgpipe's `chunks`;
    /// gradient accumulation, the same mathematics as one batch).
    #[arg(long, default_value_t = 1, value_parser = positive, conflicts_with = "chunk_size")]
    pub chunks: usize,
    /// Rows of one micro-batch (Varuna's `chunk_size`): the other way to say --chunks, which
    /// becomes --batch-size / (--dp x --chunk-size).
    #[arg(long, value_parser = positive)]
    pub chunk_size: Option<usize>,
    /// Save a checkpoint every N steps (0: never) into --checkpoint-dir.
    #[arg(long, default_value_t = 0)]
    pub checkpoint_every: u64,
    /// Where checkpoints go (default: <out>/checkpoints).
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Keep only the newest K checkpoints.
    #[arg(long, value_parser = positive)]
    pub keep: Option<usize>,
    /// Write checkpoint files in a background thread while training goes on.
    #[arg(long)]
    pub async_checkpoint: bool,
    /// The checkpoint the run goes on from: the experiment's `--checkpoint` (alias
    /// `--resume`): a checkpoint directory, or `latest` (the newest complete one in
    /// --checkpoint-dir). Any layout and precision may resume any other.
    #[arg(skip)]
    #[serde(alias = "checkpoint")]
    pub resume: Option<String>,
    /// Where each rank computes: cpu, or cuda (GPU ordinal = the rank's local rank; needs a
    /// build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// How ranks talk: threads of this process (local), or one process per rank under
    /// `mpirun -np P` (mpi; build with `--features mpi`), or NCCL between GPUs, one per rank
    /// (nccl, with --device cuda; ranks as threads, or processes under mpirun). Under mpirun
    /// or `pipewright launch` local means mpi.
    #[arg(long, value_enum, default_value = "local")]
    pub backend: crate::bench::Backend,
    /// Pipeline stages (ranks as threads of this process).
    #[arg(long, default_value_t = 1, value_parser = positive)]
    pub pp: usize,
    /// Tensor-parallel ranks per stage (Megatron's split of the GPT: heads, MLP, vocabulary).
    #[arg(long, default_value_t = 1, value_parser = positive)]
    pub tp: usize,
    /// Data-parallel replicas (each takes its rows of every batch; gradients are summed).
    #[arg(long, default_value_t = 1, value_parser = positive)]
    pub dp: usize,
    /// What the model computes in: f32, bf16, or f16 (with dynamic loss scaling); the
    /// optimizer keeps f32 master weights.
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// Pipeline schedule: gpipe, 1f1b, interleaved or zb1 (zero-bubble H1).
    #[arg(long, default_value = "1f1b")]
    pub schedule: String,
    /// Model chunks per pipeline stage (interleaved schedule).
    #[arg(long = "virtual", default_value_t = 1, value_parser = positive)]
    pub virtual_stages: usize,
    /// The machines the planner assumes when it chooses a layout (`plan`, and morphing to a
    /// new world under `launch`): a hardware file, or a built-in one: cpu-2core (this kind of
    /// machine) or h100-node.
    #[arg(long, default_value = "cpu-2core")]
    pub hardware: String,
    /// Activation recomputation: always, except_last or never.
    #[arg(long, default_value = "never")]
    pub recompute: String,
    /// Deferred batch norm: BatchNorm running statistics move once per batch, over all
    /// micro-batches (as whole-batch statistics would).
    #[arg(long)]
    pub deferred_batch_norm: bool,
    /// Write a Chrome trace of the pipeline's actions (open it in Perfetto).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Layers (or segments between cut points) per model stage: a list (`3,2`), or `time`
    /// (`auto`) or `size` to profile the model on one micro-batch here and take the balance
    /// whose slowest (largest) stage is least.
    #[arg(long)]
    pub balance: Option<String>,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Learning-rate schedule: constant, or linear warm-up then cosine decay.
    #[arg(long = "lr-schedule", value_enum, default_value = "cosine")]
    pub lr_decay: LrScheduleKind,
    /// Warm-up steps of the cosine schedule.
    #[arg(long, default_value_t = 100)]
    pub warmup: u64,
    /// Final learning rate of the cosine schedule, as a fraction of --lr.
    #[arg(long, default_value_t = 0.1)]
    pub min_lr_ratio: f64,
    #[arg(long, value_enum, default_value = "adamw")]
    pub optimizer: OptimizerKind,
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f64,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Clip the global gradient norm to this value (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    pub clip: f64,
    /// The seed of every random stream: the experiment's `--random-seed` (alias `--seed`).
    #[arg(skip)]
    #[serde(alias = "random_seed")]
    pub seed: u64,
    /// Run directory (created; must not already hold a run unless it goes on with it; default
    /// `<output-dir>/train/<date>-<time>-<id>`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Write one scalars row every K steps.
    #[arg(long, default_value_t = 1, value_parser = positive_u64)]
    pub log_every: u64,
    /// Evaluate the task's metric every K steps (and at the end).
    #[arg(long, default_value_t = 250, value_parser = positive_u64)]
    pub eval_every: u64,
    // GPT sizes.
    #[arg(long, default_value_t = 2, value_parser = positive)]
    pub n_layer: usize,
    #[arg(long, default_value_t = 4, value_parser = positive)]
    pub n_head: usize,
    #[arg(long, default_value_t = 128, value_parser = positive)]
    pub n_embd: usize,
    /// Longest sequence the GPT accepts (default: the task's sequence length).
    #[arg(long, value_parser = positive)]
    pub block_size: Option<usize>,
    #[arg(long, default_value_t = 0.0)]
    pub dropout: f64,
    /// GPT vocabulary (default: the task's); a larger one pads the vocabulary, for example to
    /// a multiple of --tp. Padded ids never occur.
    #[arg(long, value_parser = positive)]
    pub vocab_size: Option<usize>,
    // CNN sizes.
    /// CNN channels of the first blocks.
    #[arg(long, default_value_t = 16, value_parser = positive)]
    pub width: usize,
    /// CNN: a long skip connection from the stem to the head (crosses every pipeline stage).
    #[arg(long)]
    pub long_skip: bool,
    /// CNN residual blocks.
    #[arg(long, default_value_t = 4, value_parser = positive)]
    pub blocks: usize,
    // Task options.
    /// Digits of each adder operand.
    #[arg(long, default_value_t = 2, value_parser = positive)]
    pub digits: usize,
    /// Side of the shapes images.
    #[arg(long, default_value_t = 16, value_parser = positive)]
    pub image_size: usize,
}

/// Parses a size flag: a positive integer, with a message that says so.
pub fn positive_u64(s: &str) -> std::result::Result<u64, String> {
    let v: i128 = s
        .trim()
        .parse()
        .map_err(|_| format!("must be a positive integer, got `{s}`"))?;
    if v <= 0 {
        return Err(format!("must be a positive integer, got {v}"));
    }
    u64::try_from(v).map_err(|_| format!("{v} is too large"))
}

/// [`positive_u64`] as a `usize`.
pub fn positive(s: &str) -> std::result::Result<usize, String> {
    positive_u64(s).and_then(|v| usize::try_from(v).map_err(|_| format!("{v} is too large")))
}

/// The task the flags name.
pub fn make_task(a: &TrainArgs) -> Result<Box<dyn Task>> {
    if a.data.is_some() && !matches!(a.task, TaskKind::Text) {
        return Err(invalid!("--data is only read by --task text"));
    }
    Ok(match a.task {
        TaskKind::Adder => Box::new(Adder::new(a.digits, a.seed)?),
        TaskKind::Sort => Box::new(Sort::new(6, 3, a.seed)?),
        TaskKind::Shapes => Box::new(Shapes::new(a.image_size, a.seed)?),
        TaskKind::Text => {
            let path = a
                .data
                .as_ref()
                .ok_or_else(|| invalid!("--task text needs --data FILE (any text file)"))?;
            Box::new(Text::from_file(path, a.block_size.unwrap_or(64), a.seed)?)
        }
    })
}

/// A model by its configuration: what a checkpoint stores to rebuild it.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelConfig {
    /// The GPT, and the task's vocabulary (the GPT's may be padded beyond it).
    Gpt {
        gpt: GptConfig,
        vocab: usize,
    },
    Cnn {
        cnn: CnnConfig,
    },
}

impl ModelConfig {
    /// The model and its tied pairs.
    pub fn build(&self) -> Result<(Sequential, Vec<(String, String)>)> {
        Ok(match self {
            ModelConfig::Gpt { gpt: cfg, .. } => (gpt(*cfg)?, vec![(TIED.0.into(), TIED.1.into())]),
            ModelConfig::Cnn { cnn: cfg } => (cnn(*cfg)?, Vec::new()),
        })
    }

    /// Sizes a tensor-parallel size must divide (the CNN does not split: `[1]`).
    pub fn tp_divides(&self) -> Vec<usize> {
        match self {
            ModelConfig::Gpt { gpt, .. } => gpt.tp_divides(),
            ModelConfig::Cnn { .. } => vec![1],
        }
    }

    /// The planner's profile from the model's shapes in `precision` on `hw` (only the GPT has
    /// shapes the planner knows).
    pub fn shapes_profile(&self, precision: &str, hw: &Hardware) -> Result<Profile> {
        let ModelConfig::Gpt { gpt, .. } = self else {
            return Err(invalid!(
                "only the GPT is planned from its shapes: profile this model with `pipewright \
                 profile ... --out FILE` and pass --profile FILE"
            ));
        };
        gpt.shapes_profile(if precision == "f32" { 4 } else { 2 }, hw)
    }
}

/// The model the flags describe, for `task`.
pub fn make_model(a: &TrainArgs, task: &dyn Task) -> Result<ModelConfig> {
    match (a.model, task.shape()) {
        (ModelKind::Gpt, TaskShape::Tokens { vocab, seq_len }) => {
            let block_size = a.block_size.unwrap_or(seq_len);
            if block_size < seq_len {
                return Err(invalid!(
                    "--block-size {block_size} is shorter than the task's sequences of {seq_len} tokens"
                ));
            }
            let vocab_size = a.vocab_size.unwrap_or(vocab);
            if vocab_size < vocab {
                return Err(invalid!(
                    "--vocab-size {vocab_size} is smaller than the task's vocabulary of {vocab}"
                ));
            }
            if !vocab_size.is_multiple_of(a.tp) {
                let padded = vocab_size.div_ceil(a.tp) * a.tp;
                return Err(invalid!(
                    "a vocabulary of {vocab_size} cannot be split over --tp {}: pass --vocab-size {padded} \
                     (padded ids never occur)",
                    a.tp
                ));
            }
            if !a.n_head.is_multiple_of(a.tp) {
                return Err(invalid!(
                    "--n-head {} cannot be split over --tp {}: choose a multiple of --tp",
                    a.n_head,
                    a.tp
                ));
            }
            let cfg = GptConfig {
                vocab_size,
                block_size,
                n_layer: a.n_layer,
                n_head: a.n_head,
                n_embd: a.n_embd,
                dropout: a.dropout,
            };
            Ok(ModelConfig::Gpt { gpt: cfg, vocab })
        }
        (
            ModelKind::Cnn,
            TaskShape::Images {
                channels, classes, ..
            },
        ) => {
            if a.tp > 1 {
                return Err(invalid!(
                    "--tp splits the GPT's layers; the CNN has no tensor-parallel layers: use --tp 1"
                ));
            }
            let cfg = CnnConfig {
                in_channels: channels,
                classes,
                width: a.width,
                blocks: a.blocks,
                blocks_per_stage: 2,
                long_skip: a.long_skip,
            };
            Ok(ModelConfig::Cnn { cnn: cfg })
        }
        (ModelKind::Gpt, _) => Err(invalid!(
            "--model gpt needs a token task (adder, sort, text), not {}",
            task.name()
        )),
        (ModelKind::Cnn, _) => Err(invalid!(
            "--model cnn needs an image task (shapes), not {}",
            task.name()
        )),
    }
}

/// The optimizer the flags name, over `params`.
pub fn make_optimizer(
    a: &TrainArgs,
    params: Vec<(String, pipewright::candle_core::Var)>,
) -> Result<Box<dyn Optimizer>> {
    Ok(match a.optimizer {
        OptimizerKind::Adamw => Box::new(AdamW::new(
            params,
            AdamWConfig {
                weight_decay: a.weight_decay,
                ..Default::default()
            },
        )?),
        OptimizerKind::Sgd => Box::new(Sgd::new(
            params,
            SgdConfig {
                momentum: a.momentum,
                weight_decay: a.weight_decay,
                ..Default::default()
            },
        )?),
    })
}

/// The learning-rate schedule the flags describe.
pub fn schedule(a: &TrainArgs) -> LrSchedule {
    match a.lr_decay {
        LrScheduleKind::Constant => LrSchedule::Constant { lr: a.lr },
        LrScheduleKind::Cosine => LrSchedule::WarmupCosine {
            lr: a.lr,
            warmup: a.warmup.min(a.steps),
            total: a.steps,
            min_lr: a.lr * a.min_lr_ratio,
        },
    }
}
