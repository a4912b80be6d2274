//! What a rank holds besides its activations, by the byte: its parameters' state under each
//! ZeRO stage, the backward's gradient store, the rank's own bytes and ZeRO-3's whole layer.
//! The constants [`super::estimate()`] adds up into each pipeline rank's peak, each measured here
//! with [`crate::memory`]'s counting allocator where it is not a count of f32 copies.

use crate::zero::Zero;

/// Bytes per parameter a rank keeps besides its activations: the parameter, its gradient,
/// the running sum of the micro-batches' gradients and AdamW's two moments, 4 bytes each
/// (half precision keeps f32 master weights in place of the sum's width). The optimizer step
/// holds the summed gradient and no other ([`FIRST_BACKWARD_BYTES_PER_PARAM`]).
pub const STATE_BYTES_PER_PARAM: f64 = 20.0;

/// Bytes per parameter while the first backward of a step runs: no running sum yet.
pub const FIRST_BACKWARD_BYTES_PER_PARAM: f64 = 16.0;

/// A backward holds, beside the activations it consumes, this share of them again: the
/// gradients of the graph's nodes live in candle's store until the nodes they flow into are
/// done. Measured here with [`crate::memory`]: a GPT stage's live peak rose by 1.2-1.35 times
/// its kept bytes from a micro-batch of 16 to one of 64 rows, for 2 and 4 blocks.
pub const BACKWARD_EXTRA_SHARE: f64 = 0.3;

/// What a rank allocates besides its model: its schedule, batches and communicator
/// (measured here with [`crate::memory`]: a 13,600-parameter GPT rank peaks at 1.4 MiB).
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
