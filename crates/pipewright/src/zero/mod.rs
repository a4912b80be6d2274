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
//!
//! The optimizer is any [`crate::nn::optim::Optimizer`], made over the master *pieces* (a
//! piece keeps its parameter's name and rank): element-wise optimizers (AdamW, SGD) step a
//! piece exactly as they step its part of the whole parameter, so every stage trains to the
//! serial run's losses. Gradient clipping takes its norm over the pieces of every replica,
//! stage and shard; overflow skipping and loss scaling see every piece. Checkpoints stay
//! layout-free: the pieces are gathered into whole tensors to save, and cut again on load, so a
//! run saved under any stage and dp resumes under any other.
//!
//! Parameters themselves are not sharded (ZeRO-3 / FSDP): a layer holds its weights as candle
//! variables, which cannot give their memory back while a forward's graph keeps them.

mod grads;
mod plan;
mod shards;

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
}

impl Zero {
    /// The stage's number (0, 1, 2).
    pub fn number(self) -> u8 {
        match self {
            Zero::Off => 0,
            Zero::OptimizerState => 1,
            Zero::Gradients => 2,
        }
    }
}

impl TryFrom<u8> for Zero {
    type Error = Error;
    fn try_from(n: u8) -> Result<Self> {
        match n {
            0 => Ok(Zero::Off),
            1 => Ok(Zero::OptimizerState),
            2 => Ok(Zero::Gradients),
            3 => Err(invalid!(
                "ZeRO stage 3 (parameters sharded, FSDP) is not available: stage 2 shards the \
                 optimizer state, master weights and gradients"
            )),
            _ => Err(invalid!("unknown ZeRO stage {n}: use 0, 1 or 2")),
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
            .map_err(|_| invalid!("unknown ZeRO stage `{s}`: use 0, 1 or 2"))?;
        Zero::try_from(n)
    }
}

impl std::fmt::Display for Zero {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.number())
    }
}
