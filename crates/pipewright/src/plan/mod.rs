//! Planning: which layers each stage gets, what a layout will cost, and which layout a job
//! should use.
//!
//! - [`profile`]: a model's [`Profile`], each layer's time and bytes fitted over micro-batch
//!   sizes, measured here ([`measure()`]) or from a transformer's shapes and a [`Hardware`] file
//!   ([`Transformer`]); [`layer_cost`]: one micro-batch's cost of each layer
//!   ([`profile_layers`]).
//! - [`balance_by`]: profile, then balance by time or by size.
//! - [`balance`]: the contiguous split of per-layer (or per-segment) costs over pipeline stages
//!   that minimises the most expensive stage (torchgpipe's `balance_by_time` and
//!   `balance_by_size` over given costs).
//! - [`context_parallel`]: what context and sequence parallelism change in a layer's costs.
//! - [`crowding`]: what a machine loses while more ranks compute than it has cores.
//! - [`gemm`]: a matrix product's seconds by shape on a device (a roofline fitted to timings);
//!   [`shapes`]: a layer's products and element-wise passes, costed at a candidate's sizes.
//! - [`estimate`](mod@estimate): one layout's predicted step time, bubble and peak memory per stage, the
//!   schedule replayed by the simulator with the profiled costs.
//! - [`search`](mod@search): AutoConfig, every layout under a memory cap ranked by predicted step time.
//! - [`morph`](mod@morph): the layout a run restarted in a world of another size takes.
//! - [`step_parts`]: a step's time part by part, as training measures it and the estimate
//!   predicts it.

pub mod action_cost;
mod after_schedule;
pub mod attention_rate;
pub mod balance;
mod balance_ranks;
pub mod bound;
mod candidate;
pub mod cluster;
pub mod comm_bench;
pub mod context_parallel;
pub mod crowding;
pub mod estimate;
pub mod gemm;
pub mod gemm_sweep;
pub mod hardware;
pub mod layer_cost;
mod layer_pass;
pub mod measure;
mod memo;
pub mod morph;
pub mod optimizer_cost;
pub mod profile;
pub mod rank_memory;
pub mod ranking;
pub mod search;
pub mod shaped;
pub mod shapes;
mod stage_cost;
pub mod step_parts;
pub mod table;
pub mod transformer;

pub use attention_rate::{time_fused_attention, AttentionRate, AttentionTiming};
pub use balance::{balance_cost, stage_costs};
pub use balance_ranks::{balance_placed, balance_v};
pub use bound::{Bound, Breakdown, Explanation};
pub use cluster::{Cluster, Runtime};
pub use crowding::crowded_efficiency;
pub use estimate::{estimate, Candidate, Estimate};
pub use gemm::{gemm_grid, gemm_grid_peak_bytes, time_gemms, Gemm, GemmCurve, GemmTiming};
pub use gemm_sweep::GemmSweep;
pub use hardware::{format_bytes, parse_bytes, Hardware, Link};
pub use layer_cost::{median, profile_layers, profile_stage, LayerCost};
pub use measure::{measure, Sizes};
pub use morph::{morph, morph_layouts, Morph, MorphPlanner, MorphRequest};
pub use optimizer_cost::{time_optimizer, Before};
pub use profile::{
    ActionOverhead, AttentionShape, ExpertShape, Fit, LayerProfile, Profile, SplitCost, Timing,
    Transient,
};
pub use ranking::{rank, rank_pinned, Refused, Request};
pub use search::{layouts, parse_candidate, rank_specs, search};
pub use shaped::{ModelShapes, ShapedLayer};
pub use shapes::{AttentionKernel, LayerShapes, Linear, ShapeCost, TpSplit};
pub use step_parts::{Part, PartClock, StepParts};
pub use table::{format_flops, format_seconds, Ranking};
pub use transformer::Transformer;

use crate::model::batch::Batch;
use crate::model::{Build, Sequential};
use crate::parallel::pipeline::partition::unit_costs;
use crate::Result;

/// What a balance weighs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum By {
    /// Forward and backward time (torchgpipe's `balance_by_time`).
    Time,
    /// Parameter, gradient, optimizer and activation bytes (`balance_by_size`).
    Size,
}

/// The balance of `model` over model stages placed on ranks as `placement` says (units per
/// stage: layers, or segments between cut points) by profiled time or size on `sample`, one
/// micro-batch: stage by stage, or by rank where a rank holds two stages of a V
/// ([`balance_placed`]).
pub fn balance_by(
    by: By,
    model: &Sequential,
    build: &Build,
    sample: &Batch,
    placement: &[usize],
) -> Result<Vec<usize>> {
    let costs = profile_layers(model, build, sample, 3, None)?;
    let per_layer: Vec<f64> = costs
        .iter()
        .map(|c| match by {
            By::Time => c.time(),
            By::Size => c.size(),
        })
        .collect();
    balance_placed(&unit_costs(model, &per_layer), placement)
}
