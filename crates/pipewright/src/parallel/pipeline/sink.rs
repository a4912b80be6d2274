//! [`GradSink`]: where each micro-batch's finished parameter gradients go as the schedule
//! produces them, when they should not simply be summed on the rank until the batch ends
//! (ZeRO-2 reduce-scatters them at once and keeps only its shard's running sum,
//! [`crate::parallel::zero::ShardedGrads`]).

use std::ops::Range;

use crate::model::grads::Grads;
use crate::Result;

/// Takes each micro-batch's gradients of a model stage once they are complete.
pub trait GradSink {
    /// The gradients of layers `layers` (global indices) of model stage `k` for one
    /// micro-batch (after its backward, or after its weight-gradient action under a split
    /// backward; in the compute type, times the loss scale): the whole stage's at once, or
    /// one layer's at a time when the backward runs layer by layer (ZeRO-3). Returns those the
    /// pipeline should still sum itself (tied weights, which are summed between stages when
    /// the batch ends).
    fn take(&mut self, k: usize, layers: Range<usize>, grads: Grads) -> Result<Grads>;
}
