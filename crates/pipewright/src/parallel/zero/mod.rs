//! Sharded data parallelism (DeepSpeed's ZeRO, Megatron's distributed optimizer): the
//! replicas of a (stage, tensor shard) split the state each of them would otherwise hold
//! whole.
//!
//! - ZeRO-1 ([`Zero::OptimizerState`]): each replica keeps the f32 master weights and the
//!   optimizer's moments of its 1/dp of every bucket ([`ShardPlan`]), updates that part, and
//!   all-gathers the updated weights into the model. Gradients are summed whole, as plain data
//!   parallelism does.
//! - ZeRO-2 ([`Zero::Gradients`]): gradients are reduce-scattered instead, each micro-batch's
//!   as soon as the schedule completes them ([`ShardedGrads`]), so a replica keeps only its
//!   shard's running sum.
//! - ZeRO-3 / FSDP ([`Zero::Parameters`]): the model's weights too. Buckets never span two
//!   layers; a layer's weights are all-gathered from the master pieces just before each of its
//!   forwards ([`LayerGather`], a [`crate::model::LayerParams`]) and their memory given back
//!   just after. The forward is cut into one graph per layer ([`crate::parallel::pipeline::segments`]),
//!   so the backward runs one layer at a time, gathers that layer's weights again and
//!   reduce-scatters its gradients at once. (Candle cannot free a tensor that a graph holds,
//!   as FSDP's `resize_(0)` does; `storage.rs` empties and refills the storage in
//!   place instead, so the graphs see the weights only while their layer is fetched.)
//!
//! The optimizer is any [`crate::model::nn::optim::Optimizer`], made over the master *pieces* (a
//! piece keeps its parameter's name and rank): element-wise optimizers (AdamW, SGD) step a
//! piece exactly as they step its part of the whole parameter, so every stage trains to the
//! serial run's losses. Gradient clipping takes its norm over the pieces of every replica,
//! stage and shard; overflow skipping and loss scaling see every piece. Checkpoints stay
//! layout-free: the pieces are gathered into whole tensors to save, and cut again on load, so a
//! run saved under any stage and dp resumes under any other.

mod gather;
mod grads;
mod plan;
mod shards;

pub use gather::LayerGather;
pub use grads::{ShardedGrads, AFTER_PIPELINE};
pub use plan::{ParamSpec, Piece, ShardPlan};
pub use shards::ZeroShards;

use crate::{invalid, Error, Result};

/// Which state the data-parallel replicas shard (`VarunaOptions::zero`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "u8", into = "u8")]
pub enum Zero {
    /// Every replica holds everything (plain data parallelism).
    #[default]
    Off,
    /// ZeRO-1: master weights and optimizer state.
    OptimizerState,
    /// ZeRO-2: master weights, optimizer state and gradients.
    Gradients,
    /// ZeRO-3 (FSDP): master weights, optimizer state, gradients and the model's weights.
    Parameters,
}

impl Zero {
    /// The stage's number (0, 1, 2, 3).
    pub fn number(self) -> u8 {
        match self {
            Zero::Off => 0,
            Zero::OptimizerState => 1,
            Zero::Gradients => 2,
            Zero::Parameters => 3,
        }
    }

    /// Whether gradients are reduce-scattered as the pipeline completes them (stages 2, 3).
    pub fn shards_grads(self) -> bool {
        matches!(self, Zero::Gradients | Zero::Parameters)
    }
}

impl TryFrom<u8> for Zero {
    type Error = Error;
    fn try_from(n: u8) -> Result<Self> {
        match n {
            0 => Ok(Zero::Off),
            1 => Ok(Zero::OptimizerState),
            2 => Ok(Zero::Gradients),
            3 => Ok(Zero::Parameters),
            _ => Err(invalid!("unknown ZeRO stage {n}: use 0, 1, 2 or 3")),
        }
    }
}

impl From<Zero> for u8 {
    fn from(z: Zero) -> u8 {
        z.number()
    }
}

impl std::str::FromStr for Zero {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let n: u8 = s
            .trim()
            .parse()
            .map_err(|_| invalid!("unknown ZeRO stage `{s}`: use 0, 1, 2 or 3"))?;
        Zero::try_from(n)
    }
}

impl std::fmt::Display for Zero {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.number())
    }
}
