//! What a pipeline rank holds at its peak, by the byte: its stages' activations as the schedule
//! holds them, its parameters' state under each ZeRO stage, the backward's transient bytes,
//! the rank's own bytes and ZeRO-3's whole layer: what [`super::estimate()`] adds up into each
//! pipeline rank's peak. The constants are measured here with [`crate::runtime::memory`]'s counting
//! allocator where they are not a count of f32 copies.

use super::profile::{LayerProfile, SplitCost};
use crate::parallel::pipeline::timeline::Held;
use crate::parallel::pipeline::Recompute;
use crate::parallel::zero::Zero;

/// What one model stage holds for one micro-batch, in bytes (a rank's share of each under
/// context parallelism).
#[derive(Clone, Copy, Debug)]
pub(super) struct StageBytes {
    /// Its largest layer's parameters, in elements (ZeRO-3 holds one layer's whole at a time).
    pub largest: f64,
    /// What its forward keeps for the backward ...
    pub kept: f64,
    /// ... and for the split backward of zero-bubble schedules (its plain ops keep more than
    /// the fused kernels of the whole backward).
    pub split_kept: f64,
    /// The most transient bytes one of its layers holds while it computes (attention).
    pub working: f64,
    /// What the split backward holds from its input pass to its weight pass.
    pub deferred: f64,
    /// Its input (kept for its backward, or for recomputing its forward).
    pub input: f64,
    /// What its backward holds beyond its activations and the parameters' gradients, whole
    /// and its split input pass, as measured (`None` when a layer has no measurement): the sum
    /// of what its layers' gradient stores still hold when each layer's backward ends (kept
    /// until the stage's backward ends), and the most one layer holds beyond that while it runs.
    pub transient: Option<[[f64; 2]; 2]>,
}

impl StageBytes {
    /// A stage with no layers yet, whose input is `input` bytes.
    pub fn new(input: f64) -> Self {
        StageBytes {
            largest: 0.0,
            kept: 0.0,
            split_kept: 0.0,
            working: 0.0,
            deferred: 0.0,
            input,
            transient: Some([[0.0; 2]; 2]),
        }
    }

    /// Adds layer `l` for `rows` samples (a rank's share of them): its shard as measured at
    /// this `tp` size (`m`, whose collectives' outputs are live tensors of its graph), else
    /// modelled from the unsplit layer (`sp`: sequence parallelism splits the part of its kept
    /// bytes tensor parallelism does not).
    pub fn add(&mut self, l: &LayerProfile, m: Option<&SplitCost>, tp: usize, sp: bool, rows: f64) {
        let t = if l.tp_split { tp as f64 } else { 1.0 };
        let whole = l.kept_whole_bytes_per_sample.min(l.kept_bytes_per_sample);
        let kept = match m.and_then(|m| m.kept_bytes_per_sample) {
            Some(k) if !sp => k,
            _ if sp => l.kept_bytes_per_sample / t,
            _ => whole + (l.kept_bytes_per_sample - whole) / t,
        };
        self.kept += kept * rows;
        // The split backward's plain ops keep more than the fused kernels, in proportion.
        let split_kept = match m.and_then(|m| m.split_kept_bytes_per_sample) {
            Some(k) if !sp => k,
            _ => match l.split_kept_bytes_per_sample {
                Some(k) if l.kept_bytes_per_sample > 0.0 => kept * k / l.kept_bytes_per_sample,
                _ => kept,
            },
        };
        self.split_kept += split_kept * rows;
        let deferred = m.and_then(|m| m.deferred_bytes_per_sample);
        self.deferred += deferred.unwrap_or(l.deferred_bytes_per_sample / t) * rows;
        let layer = match m {
            Some(m) => m.transient,
            None if tp == 1 => l.transient,
            None => None,
        };
        let add = |[kept, most]: [f64; 2], peak: f64, ended: f64| {
            let ended = ended.min(peak) * rows;
            [kept + ended, most.max(peak * rows - ended)]
        };
        self.transient = self.transient.zip(layer).map(|([whole, input], t)| {
            [
                add(
                    whole,
                    t.backward_bytes_per_sample,
                    t.backward_kept_bytes_per_sample,
                ),
                add(
                    input,
                    t.input_bytes_per_sample,
                    t.input_kept_bytes_per_sample,
                ),
            ]
        });
    }
}

/// The most bytes a pipeline rank holds (beyond the runtime's): its model stages `stages` (one
/// per virtual stage) with `params` parameters, `state` its bytes per parameter in a backward
/// and in the optimizer step ([`state_bytes_per_param`]), `held` what the schedule has it hold
/// as each of its actions starts, `split` whether its backward is split (zero-bubble), `zero3`
/// whether ZeRO-3 shards its weights. The peak is in a backward (the activations held, the
/// backward's transient bytes, the state) or in the optimizer step, whichever holds more.
pub(super) fn rank_live_bytes(
    stages: &[&StageBytes],
    params: f64,
    (per_param, step_per_param): (f64, f64),
    held: &[Held],
    recompute: Recompute,
    split: bool,
    zero3: bool,
) -> f64 {
    let v = stages.len().max(1) as f64;
    let kept = |c: &StageBytes| if split { c.split_kept } else { c.kept };
    let kept_max = stages.iter().map(|c| kept(c)).fold(0.0, f64::max);
    let kept_mean = stages.iter().map(|c| kept(c)).sum::<f64>() / v;
    let input_mean = stages.iter().map(|c| c.input).sum::<f64>() / v;
    let deferred_mean = stages.iter().map(|c| c.deferred).sum::<f64>() / v;
    // The most the rank's micro-batches hold as one of its actions starts: their kept
    // activations (a recomputed micro-batch keeps its stage input until its backward runs the
    // forward again, which then holds that micro-batch's activations), and the split
    // backward's queues waiting for their weight passes.
    let held = held
        .iter()
        .map(|h| {
            let g = h.graphs as f64;
            let graphs = match recompute {
                Recompute::Never => g * (kept_mean + input_mean),
                Recompute::Always => g * input_mean + kept_max,
                Recompute::ExceptLast => (g - 1.0).max(0.0) * input_mean + 2.0 * kept_max,
            };
            graphs + h.queues as f64 * deferred_mean
        })
        .fold(0.0, f64::max);
    let working = stages.iter().map(|c| c.working).fold(0.0, f64::max);
    // What a backward holds at its peak beyond its activations and the parameters' state: as
    // measured layer by layer (the earlier layers' gradient stores beside the largest layer's
    // own peak), else a share of the kept bytes.
    let measured = stages
        .iter()
        .map(|c| c.transient)
        .collect::<Option<Vec<_>>>();
    let extra = match measured {
        Some(t) => t
            .iter()
            .map(|t| t[usize::from(split)].iter().sum::<f64>())
            .fold(0.0, f64::max),
        None => BACKWARD_EXTRA_SHARE * kept_max,
    };
    let mut backward = params * per_param + held + extra + working;
    if zero3 {
        let largest = stages.iter().map(|c| c.largest).fold(0.0, f64::max);
        backward += ZERO3_LAYER_COPIES * 4.0 * largest;
    }
    RANK_BYTES + backward.max(params * step_per_param)
}

/// Bytes per parameter a rank keeps besides its activations: the parameter, its gradient,
/// the running sum of the micro-batches' gradients and AdamW's two moments, 4 bytes each
/// (half precision keeps f32 master weights in place of the sum's width). The optimizer step
/// holds the summed gradient and no other ([`FIRST_BACKWARD_BYTES_PER_PARAM`]).
pub const STATE_BYTES_PER_PARAM: f64 = 20.0;

/// Bytes per parameter while the first backward of a step runs: no running sum yet.
pub const FIRST_BACKWARD_BYTES_PER_PARAM: f64 = 16.0;

/// A backward holds, beside the activations it consumes, this share of them again: the
/// gradients of the graph's nodes live in candle's store until the nodes they flow into are
/// done. Measured here with [`crate::runtime::memory`]: a GPT stage's live peak rose by 1.2-1.35 times
/// its kept bytes from a micro-batch of 16 to one of 64 rows, for 2 and 4 blocks.
pub const BACKWARD_EXTRA_SHARE: f64 = 0.3;

/// What a rank allocates besides its model: its schedule, batches and communicator
/// (measured here with [`crate::runtime::memory`]: a 13,600-parameter GPT rank peaks at 1.4 MiB).
pub const RANK_BYTES: f64 = 1.2 * 1024.0 * 1024.0;

/// Bytes per parameter a rank keeps under `zero` over `dp` replicas (4-byte values, as
/// [`STATE_BYTES_PER_PARAM`] counts them): in a backward (`first`: the step's first, before any
/// running sum) and in the optimizer step, where the clipped gradient replaces the summed one
/// parameter by parameter. ZeRO-1 shards the moments and keeps f32 master pieces (the model's
/// weights are no longer the masters); ZeRO-2 sums into its pieces from the first micro-batch
/// on, and its step holds only its pieces of the summed gradients; ZeRO-3 holds no whole
/// weights either (a layer's are whole only while it computes: [`ZERO3_LAYER_COPIES`]).
pub fn state_bytes_per_param(zero: Zero, dp: usize, first: bool) -> (f64, f64) {
    let d = dp.max(1) as f64;
    let sum = if first { 0.0 } else { 4.0 };
    match zero {
        Zero::OptimizerState if dp > 1 => (8.0 + sum + 12.0 / d, 8.0 + 12.0 / d),
        Zero::Gradients if dp > 1 => (8.0 + 16.0 / d, 4.0 + 16.0 / d),
        // The weights too: a layer's are whole only while it computes.
        Zero::Parameters if dp > 1 => (16.0 / d, 16.0 / d),
        _ => (
            FIRST_BACKWARD_BYTES_PER_PARAM + sum,
            FIRST_BACKWARD_BYTES_PER_PARAM,
        ),
    }
}

/// Whole copies of one layer's parameters ZeRO-3 holds at once, beside its sharded state: in
/// the layer's backward, its gathered weights, their gradient and the flat copy of it the
/// reduce-scatter sends (4-byte values).
pub const ZERO3_LAYER_COPIES: f64 = 3.0;
