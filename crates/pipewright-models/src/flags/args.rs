//! The flags of a run ([`TrainArgs`]) and the parsers of their values; what they build is in
//! `spec.rs`.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use serde::{Deserialize, Serialize};

use pipewright::model::precision::Precision;
use pipewright::parallel::pipeline::PipelineSpec;
use pipewright::trainer::Cadence;

use super::sections::*;
use crate::{CnnConfig, GptConfig, LlamaConfig};

/// The models' own defaults the size flags start from (a size the task gives, such as the
/// vocabulary, is the task's).
pub(super) const SMALL: GptConfig = GptConfig::small(0, 0);
pub(super) const SMALL_LLAMA: LlamaConfig = LlamaConfig::small(0, 0);
pub(super) const SMALL_CNN: CnnConfig = CnnConfig::small(0, 0);

/// Which reference model (`--model`).
#[derive(Clone, Copy, Debug, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    /// A GPT-2-shaped decoder.
    Gpt,
    /// A Llama: RMSNorm, SwiGLU, rotary positions, grouped-query attention.
    Llama,
    /// A CNN with skip connections and batch norm.
    Cnn,
}

/// What the model learns (`--task`).
#[derive(Clone, Copy, Debug, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskKind {
    /// Sums of two numbers.
    Adder,
    /// Sorting a sequence of symbols.
    Sort,
    /// A text file's bytes (with --data).
    Text,
    /// Shapes in images (the CNN's).
    Shapes,
    /// A prepared corpus's token shards (with --data).
    Tokens,
}

/// The optimizer (`--optimizer`).
#[derive(Clone, Copy, Debug, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    /// AdamW with decoupled weight decay.
    Adamw,
    /// SGD with momentum.
    Sgd,
}

/// The learning rate's course (`--lr-schedule`).
#[derive(Clone, Copy, Debug, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrScheduleKind {
    /// The same rate every step.
    Constant,
    /// Linear warm-up, then cosine decay to the minimum.
    Cosine,
}

/// Every flag of a run, in the sections a run is described by; written flat to `params.json`
/// (each section's flags beside the others, as they were before there were sections).
#[derive(Args, Clone, Debug, Serialize, Deserialize)]
pub struct TrainArgs {
    /// The model: a GPT-2-shaped decoder (gpt), a Llama (RMSNorm, SwiGLU, rotary positions,
    /// grouped-query attention), or a CNN with skip connections and batch norm (cnn).
    #[arg(help_heading = "Model", long, value_enum, default_value = "gpt")]
    pub model: ModelKind,
    /// What it learns: sums of numbers (adder), sorting (sort), a text file's bytes (text,
    /// with --data), shapes in images (shapes, the CNN's), or a prepared corpus's token
    /// shards (tokens, with --data).
    #[arg(help_heading = "Task", long, value_enum, default_value = "adder")]
    pub task: TaskKind,
    /// The model's sizes and pretrained weights.
    #[command(flatten)]
    #[serde(flatten)]
    pub sizes: ModelArgs,
    /// The task's data and sizes.
    #[command(flatten)]
    #[serde(flatten)]
    pub inputs: TaskArgs,
    /// The batch and its micro-batches.
    #[command(flatten)]
    #[serde(flatten)]
    pub batch: BatchArgs,
    /// Device, backend, layout, ZeRO and overlap.
    #[command(flatten)]
    #[serde(flatten)]
    pub parallel: ParallelArgs,
    /// Schedule, balance, recompute and deferred batch norm.
    #[command(flatten)]
    #[serde(flatten)]
    pub pipeline: PipelineSpec,
    /// Run this schedule, written as data (one rank's actions per line, `0F0,0F1,0B0,...`, as
    /// `pipewright schedule --save` writes it, or a PyTorch dump), in place of --schedule;
    /// checked complete and deadlock-free before anything is built.
    #[arg(
        help_heading = "Parallelism",
        long,
        value_name = "FILE",
        conflicts_with = "schedule"
    )]
    pub schedule_file: Option<PathBuf>,
    /// What the model computes in: f32, bf16, or f16 (with dynamic loss scaling); the
    /// optimizer keeps f32 master weights.
    #[arg(help_heading = "Parallelism", long, default_value = "f32")]
    pub precision: Precision,
    /// Optimizer, learning rate and clipping.
    #[command(flatten)]
    #[serde(flatten)]
    pub optim: OptimArgs,
    /// Checkpoints and resuming.
    #[command(flatten)]
    #[serde(flatten)]
    pub checkpoint: CheckpointArgs,
    /// The run directory, logging, evaluation, trace and report.
    #[command(flatten)]
    #[serde(flatten)]
    pub output: OutputArgs,
    /// Steps, and when the run evaluates, logs and saves.
    #[command(flatten)]
    #[serde(flatten)]
    pub cadence: Cadence,
    /// The seed of every random stream: the experiment's `--random-seed` (alias `--seed`).
    #[arg(skip)]
    #[serde(alias = "random_seed")]
    pub seed: u64,
}

pub use pipewright::runtime::flag_values::{finite, positive, positive_mb, positive_u64};

/// Which parameters AdamW decays (`--decay`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "kebab-case")]
pub enum DecayKind {
    /// Every parameter of two or more dimensions.
    #[default]
    MatricesAndEmbeddings,
    /// Those but embedding tables and a head tied to one.
    Matrices,
}

// Runs recorded before the AdamW flags existed (their parameters.json has none) resume with
// PyTorch's defaults, which they trained with.
pub(super) fn default_beta1() -> f64 {
    0.9
}
pub(super) fn default_beta2() -> f64 {
    0.999
}
pub(super) fn default_eps() -> f64 {
    1e-8
}

/// The flags' defaults (what `pipewright train` alone runs).
pub(super) fn defaults() -> TrainArgs {
    use clap::Parser;
    #[derive(Parser)]
    struct Only {
        #[command(flatten)]
        a: TrainArgs,
    }
    Only::parse_from(["train"]).a
}
