//! pipewright: pipeline, tensor and data parallel training on candle.
//!
//! The library in rooms, each built only on the ones above it in this list (no file and no room
//! imports a later one; `tools/import_cycles.py` checks it):
//! - [`runtime`]: the process and its machine: [`runtime::device`] (a [`candle_core::Device`] by
//!   name), [`runtime::memory`] (allocator-counted bytes per rank), files a command may write,
//!   sizes in bytes, printing, seeds.
//! - [`distributed`]: who this process is (torchrun, `mpirun`, Slurm or nothing) and
//!   [`distributed::init()`]; [`distributed::comm`], the [`distributed::comm::Communicator`]
//!   trait (send/recv, all_reduce, all_gather, reduce_scatter, broadcast, barrier, sub-groups)
//!   and its backends; [`distributed::topology`], [`distributed::topology::Layout`]
//!   `{pp, tp, cp, dp}` and [`distributed::topology::Topology`] (Varuna's `stage_to_rank_map`).
//! - [`model`]: [`Layer`], [`LayerSpec`], [`Sequential`] (layer specs with cut points), [`Build`],
//!   [`Stage`], [`Activation`], [`Cx`]; [`model::batch`] ([`Batch`], named tensors split into
//!   micro-batches), [`model::nn`] (local differentiable layers and optimizers),
//!   [`model::init`] (name-keyed seeded init), [`model::grads`], [`model::precision`]
//!   (bf16/f16 with f32 masters, dynamic loss scaling); the layers run on `kernels` (crate
//!   private, below `model`): fused ops with their own backward, on the CPU and in CUDA.
//! - [`parallel`]: one axis per module: [`parallel::tensor_parallel`] (TorchShard: `slice`,
//!   parallel layers, vocabulary-parallel cross-entropy, `collect_state_dict` /
//!   `relocate_state_dict`), [`parallel::context_parallel`] (causal ring attention),
//!   [`parallel::data_parallel`] (bucketed gradient sums, the distributed loader),
//!   [`parallel::zero`] (ZeRO 1/2/3), [`parallel::pipeline`] (partitions, schedules as data,
//!   one rank's executor), and [`parallel::loss`] (the [`Loss`] trait: a sum and the count it
//!   averages over).
//! - [`plan`]: profiling layers, balancing stages by time or size, and ranking layouts.
//! - [`engine`]: one rank's training step and its state: [`engine::varuna::Varuna`] (any
//!   layout, any device), [`engine::serial::SerialTrainer`] (the oracle of every layout),
//!   [`engine::checkpoint`] (layout-free, atomic, loadable into any layout).
//! - [`experiment`]: pystematic's run directory, parameters, [`experiment::Context`],
//!   [`experiment::Recorder`] (TensorBoard + CSV), sweeps and the report page.
//! - [`trainer`]: the front door: a [`trainer::Run`] (spec, model, loss, data, place) that
//!   [`trainer::Trainer`] prepares once (morphing a restart, resolving the balance, every
//!   check) and trains on every rank with the program's hooks; [`ModelSpec`], what a model
//!   says about itself; [`trainer::launch`], the launcher that restarts a run.
//! - [`data`]: corpora: the BPE tokenizer, token shards and their loader.
//! - [`Error`] / [`Result`]: every fallible call.

#![warn(missing_docs)]
// No function over 100 lines (the threshold is in the workspace's clippy.toml): a longer one
// is split into named steps.
#![warn(clippy::too_many_lines)]

pub mod data;
pub mod distributed;
pub mod engine;
pub mod error;
pub mod experiment;
pub(crate) mod kernels;
pub mod model;
pub mod parallel;
pub mod plan;
pub mod runtime;
pub mod trainer;

pub use candle_core;
pub use error::{Error, Result};
pub use model::batch::Batch;
pub use model::{Activation, Build, Cx, Layer, LayerSpec, Mode, Sequential, Stage};
pub use parallel::loss::Loss;
pub use trainer::model_spec::ModelSpec;
