//! Planning: which layers each stage gets, and (later) which layout a job should use.
//!
//! - [`profile`]: each layer's forward and backward time, parameter and activation bytes.
//! - [`balance_by`]: profile, then balance by time or by size.
//! - [`balance`]: the contiguous split of per-layer (or per-segment) costs over pipeline stages
//!   that minimises the most expensive stage (torchgpipe's `balance_by_time` and
//!   `balance_by_size` over given costs).

pub mod balance;
pub mod profile;

pub use balance::{balance_cost, stage_costs};
pub use profile::{profile_layers, LayerCost};

use crate::batch::Batch;
use crate::model::{Build, Sequential};
use crate::pipeline::partition::unit_costs;
use crate::Result;

/// What a balance weighs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum By {
    /// Forward and backward time (torchgpipe's `balance_by_time`).
    Time,
    /// Parameter, gradient, optimizer and activation bytes (`balance_by_size`).
    Size,
}

/// The balance of `model` over `stages` stages (units per stage: layers, or segments between
/// cut points) by profiled time or size on `sample`, one micro-batch.
pub fn balance_by(
    by: By,
    model: &Sequential,
    build: &Build,
    sample: &Batch,
    stages: usize,
) -> Result<Vec<usize>> {
    let costs = profile_layers(model, build, sample, 3)?;
    let per_layer: Vec<f64> = costs
        .iter()
        .map(|c| match by {
            By::Time => c.time(),
            By::Size => c.size(),
        })
        .collect();
    balance_cost(&unit_costs(model, &per_layer), stages)
}
