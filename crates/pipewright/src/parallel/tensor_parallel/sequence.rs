//! Megatron's sequence parallelism: between the tensor-parallel layers (norms, residual adds,
//! dropout) activations are split along the sequence over the tensor-parallel group instead of
//! whole on every rank, so their memory falls by the group's size.
//!
//! The regions change at the tensor-parallel layers: a column-parallel layer all-gathers its
//! input along the sequence (the backward reduce-scatters), a row-parallel layer
//! reduce-scatters its partial outputs along it (the backward all-gathers) — the same bytes as
//! the all-reduce they replace. A norm's weights see only this rank's positions, so their
//! gradients are summed over the group ([`SequenceParallel::weight`]). Dropout in the split
//! region draws this rank's part of the serial run's mask. The model enters the split region
//! after its embedding ([`SequenceParallel::scatter`]) and leaves it before the output head.

use candle_core::Tensor;

use super::ops::{copy_to_group, gather_sequence, scatter_to_group};
use crate::distributed::comm::Group;
use crate::model::nn::Dropout;
use crate::model::{Build, Cx};
use crate::{invalid, Result};

/// Whether and over which group a layer's activations are split along the sequence.
#[derive(Clone, Debug, Default)]
pub struct SequenceParallel {
    group: Group,
    on: bool,
}

impl SequenceParallel {
    /// As `build` says: on when sequence parallelism is asked for and tp > 1.
    pub fn new(build: &Build) -> Self {
        Self {
            group: build.tp.clone(),
            on: build.splits_sequence(),
        }
    }

    /// Whether activations are split along the sequence.
    pub fn is_on(&self) -> bool {
        self.on
    }

    fn check(&self, x: &Tensor) -> Result<()> {
        let (t, n) = (x.dim(1)?, self.group.size());
        if !t.is_multiple_of(n) {
            return Err(invalid!(
                "sequence parallelism splits each sequence over {n} tensor-parallel ranks, but \
                 this rank holds {t} tokens: make the sequence length (per context-parallel rank) \
                 a multiple of {n}, or turn sequence parallelism off"
            ));
        }
        Ok(())
    }

    /// Into the split region from a tensor whole on every rank (after the embedding): this
    /// rank's part of the sequence (backward: all-gather).
    pub fn scatter(&self, x: &Tensor) -> Result<Tensor> {
        if !self.on {
            return Ok(x.clone());
        }
        self.check(x)?;
        scatter_to_group(x, &self.group, 1, 1)
    }

    /// Out of the split region: the whole sequence on every rank (backward: reduce-scatter),
    /// for layers that read it together (see [`super::ParallelLinear::forward_gathered`]).
    pub fn gather(&self, x: &Tensor) -> Result<Tensor> {
        if !self.on {
            return copy_to_group(x, &self.group);
        }
        gather_sequence(x, &self.group)
    }

    /// A norm's weight as the split region uses it: its gradient summed over the group (each
    /// rank saw only its positions).
    pub fn weight(&self, w: &Tensor) -> Result<Tensor> {
        if !self.on {
            return Ok(w.clone());
        }
        copy_to_group(w, &self.group)
    }

    /// `drop` on a tensor of the split region: this rank's part of the whole sequence's mask.
    pub fn dropout(&self, drop: &Dropout, x: &Tensor, cx: &Cx) -> Result<Tensor> {
        if !self.on {
            return drop.forward(x, cx);
        }
        drop.forward_part(x, cx, 1, self.group.rank(), self.group.size())
    }
}
