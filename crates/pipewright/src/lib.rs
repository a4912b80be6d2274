//! pipewright: pipeline, tensor and data parallel training on candle.
//!
//! The public API in one screen:
//! - [`model`]: [`Layer`], [`LayerSpec`], [`Sequential`] (layer specs with cut points), [`Stage`]
//!   (a built range of layers), [`Activation`], [`Cx`] (mode, recompute flag, skip stash).
//! - [`nn`]: differentiable layers (Linear, Embedding, LayerNorm, GELU, causal attention,
//!   dropout, Conv2d, BatchNorm2d, cross-entropy), [`nn::Init`] (name-keyed seeded init),
//!   [`nn::Grads`], and [`nn::optim`] (SGD, AdamW, schedules, clipping) with saveable state.
//! - [`pipeline::microbatch`]: splitting batches into micro-batches.
//! - [`serial`]: [`serial::SerialTrainer`], single-device training, the oracle of every layout.
//! - [`experiment`]: run directory, [`experiment::Recorder`] (TensorBoard + CSV).
//! - [`topology`]: [`topology::Layout`] `{pp, tp, dp}`, [`topology::Topology`] (Varuna's
//!   `stage_to_rank_map`), rank <-> (stage, tp_rank, dp_rank), axis groups.
//! - [`comm`]: the [`comm::Communicator`] trait (send/recv, all_reduce, all_gather,
//!   reduce_scatter, broadcast, barrier, sub-groups) and [`comm::local`] (ranks as threads).
//! - [`shard`]: tensor parallelism (TorchShard): `slice`, [`shard::ParallelLinear`],
//!   [`shard::ParallelEmbedding`], vocabulary-parallel cross-entropy, collectives as autograd
//!   ops, parallel-dim metadata, `collect_state_dict` / `relocate_state_dict`.
//! - [`varuna`]: [`varuna::Varuna`], the one step over any pp x tp x dp layout, with
//!   [`data_parallel`] (bucketed gradient sums, the distributed loader) and [`precision`]
//!   (bf16/f16 with f32 masters, dynamic loss scaling).
//! - [`Error`] / [`Result`]: every fallible call.

pub mod comm;
pub mod data_parallel;
pub mod error;
pub mod experiment;
pub mod model;
pub mod nn;
pub mod pipeline;
pub mod precision;
pub mod serial;
pub mod shard;
pub mod topology;
pub mod varuna;

pub use candle_core;
pub use error::{Error, Result};
pub use model::{Activation, Cx, Layer, LayerSpec, Mode, Sequential, Stage};
