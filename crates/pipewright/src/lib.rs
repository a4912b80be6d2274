//! pipewright: pipeline, tensor and data parallel training on candle.
//!
//! The public API in one screen:
//! - [`model`]: [`Layer`], [`LayerSpec`], [`Sequential`] (layer specs with cut points and the
//!   inputs they take), [`Build`] (what a builder gets), [`Stage`] (a built range of layers),
//!   [`Activation`] (a tensor or a tuple), [`Cx`] (mode, recompute flag, skip stash).
//! - [`batch`]: [`Batch`], named tensors split into micro-batches.
//! - [`loss`]: the [`Loss`] trait (a sum and the count it averages over), [`loss::CrossEntropy`]
//!   (vocabulary-parallel when the output is split) and [`loss::Mse`].
//! - [`device`]: a [`candle_core::Device`] by name, with a clear error when it is missing.
//! - [`nn`]: local math: differentiable layers (Linear, Embedding, LayerNorm, GELU, dropout,
//!   Conv2d, BatchNorm2d, cross-entropy), [`nn::Init`] (name-keyed seeded init),
//!   [`nn::Grads`], and [`nn::optim`] (SGD, AdamW, schedules, clipping) with saveable state.
//! - [`pipeline`]: partitions, schedules as data, and the executor of one rank's actions
//!   ([`pipeline::Pipeline`]: one batch's loss and gradients, no optimizer).
//! - [`serial`]: [`serial::SerialTrainer`], single-device training, the oracle of every layout.
//! - [`experiment`]: run directory, [`experiment::Recorder`] (TensorBoard + CSV).
//! - [`topology`]: [`topology::Layout`] `{pp, tp, cp, dp}`, [`topology::Topology`] (Varuna's
//!   `stage_to_rank_map`), rank <-> (stage, tp_rank, cp_rank, dp_rank), axis groups.
//! - [`context_parallel`]: sequences split over a ring of ranks, causal ring attention with
//!   load-balanced chunks.
//! - [`comm`]: the [`comm::Communicator`] trait (send/recv, all_reduce, all_gather,
//!   reduce_scatter, broadcast, barrier, sub-groups) and [`comm::local`] (ranks as threads).
//! - [`shard`]: tensor parallelism (TorchShard): `slice`, [`shard::ParallelLinear`],
//!   [`shard::ParallelEmbedding`], [`shard::CausalSelfAttention`] (heads split),
//!   vocabulary-parallel cross-entropy, collectives as autograd
//!   ops, parallel-dim metadata, `collect_state_dict` / `relocate_state_dict`.
//! - [`varuna`]: [`varuna::Varuna`], the one training step of the library, over any
//!   pp x tp x dp layout (1 x 1 x 1 included), on any device, with
//!   [`data_parallel`] (bucketed gradient sums, the distributed loader) and [`precision`]
//!   (bf16/f16 with f32 masters, dynamic loss scaling).
//! - [`checkpoint`]: layout-free checkpoints (manifest, safetensors parts, atomic save, load
//!   into any layout, verify); `Varuna::checkpoint` / `load_checkpoint` use it.
//! - [`dist`]: who this process is (torchrun, `mpirun`, Slurm or nothing), `dist::init()` for
//!   the world communicator, heartbeats for `pipewright launch`.
//! - [`zero`]: sharded data parallelism (ZeRO-1/2): optimizer state, master weights and
//!   gradients split over the replicas.
//! - [`plan`]: profiling layers and balancing stages by time or size.
//! - [`model_spec`]: [`ModelSpec`], what a model says about itself (build, tied pairs,
//!   parallel rules, shapes for the planner, Hugging Face names).
//! - [`trainer`]: the front door: a [`trainer::Run`] (spec, model, loss, data, place) that
//!   [`trainer::Trainer`] prepares once (morphing a restart, resolving the balance, every
//!   check) and trains on every rank with the program's hooks.
//! - [`Error`] / [`Result`]: every fallible call.

#![warn(missing_docs)]
// No function over 100 lines (the threshold is in the workspace's clippy.toml): a longer one
// is split into named steps.
#![warn(clippy::too_many_lines)]

pub mod axis;
pub mod batch;
pub mod bytes;
pub mod checkpoint;
pub mod comm;
pub mod console;
pub mod context_parallel;
pub mod cpu_time;
pub mod data;
pub mod data_parallel;
pub mod device;
pub mod dist;
pub mod error;
pub mod experiment;
pub mod files;
pub mod grads;
pub mod init;
mod kernels;
pub mod launch;
pub mod loss;
pub mod memory;
pub mod model;
pub mod model_spec;
pub mod nn;
pub mod pipeline;
pub mod plan;
pub mod precision;
pub mod serial;
pub mod shard;
mod storage;
pub mod topology;
pub mod trainer;
pub mod varuna;
pub mod zero;

pub use batch::Batch;
pub use candle_core;
pub use error::{Error, Result};
pub use loss::Loss;
pub use model::{Activation, Build, Cx, Layer, LayerSpec, Mode, Sequential, Stage};
pub use model_spec::ModelSpec;
