//! The collectives inside tensor-parallel layers, as autograd ops (Megatron's mappings). Each
//! runs its collective in the forward and the conjugate one in the backward:
//!
//! | op | forward | backward |
//! | --- | --- | --- |
//! | [`copy_to_group`] | identity | all-reduce (sum) |
//! | [`reduce_from_group`] | all-reduce (sum) | identity |
//! | [`gather_from_group`] | all-gather, join | keep own part |
//! | [`scatter_to_group`] | keep own part | all-gather, join |
//! | [`gather_sequence`] | all-gather along the sequence | reduce-scatter along it |
//! | [`reduce_scatter_sequence`] | reduce-scatter along the sequence | all-gather along it |
//!
//! The last two are Megatron's sequence-parallel regions (dim 1 of `(batch, sequence, ...)`):
//! where tensor parallelism all-reduces a row-parallel layer's output, sequence parallelism
//! reduce-scatters it along the sequence, and all-gathers before the next column-parallel
//! layer.
//!
//! Every member of the group must call them in the same order, forward and backward; the
//! layers do, because every tensor-parallel rank builds the same graph. In a group of one they
//! are the identity and add nothing to the graph.

use candle_core::Tensor;

use super::{assemble, part};
use crate::distributed::comm::precomputed;
use crate::distributed::comm::Group;
use crate::distributed::comm::ReduceOp;
use crate::Result;

#[derive(Clone, Copy, Debug)]
enum Kind {
    Copy,
    Reduce,
    Gather { axis: usize, stride: usize },
    Scatter { axis: usize, stride: usize },
    SeqGather,
    SeqReduceScatter,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Copy => "copy-to-group",
            Kind::Reduce => "reduce-from-group",
            Kind::Gather { .. } => "gather-from-group",
            Kind::Scatter { .. } => "scatter-to-group",
            Kind::SeqGather => "gather-sequence",
            Kind::SeqReduceScatter => "reduce-scatter-sequence",
        }
    }

    /// The conjugate collective of `grad`.
    fn backward(self, g: &Group, grad: &Tensor) -> Result<Tensor> {
        match self {
            Kind::Copy => g.all_reduce(grad, ReduceOp::Sum),
            Kind::Reduce => Ok(grad.clone()),
            Kind::Gather { axis, stride } => part(grad, axis, stride, g.rank(), g.size()),
            Kind::Scatter { axis, stride } => {
                let parts = g.all_gather(&grad.contiguous()?)?;
                assemble(&parts, axis, stride)
            }
            Kind::SeqGather => reduce_scatter_dim1(grad, g),
            Kind::SeqReduceScatter => all_gather_dim1(grad, g),
        }
    }
}

fn apply(x: &Tensor, value: Tensor, kind: Kind, group: &Group) -> Result<Tensor> {
    let g = group.clone();
    precomputed(x, value, kind.name(), move |grad| kind.backward(&g, grad))
}

/// Identity forward, all-reduce backward: feeds a replicated tensor into a column-parallel
/// layer, whose every rank contributes part of its gradient.
pub fn copy_to_group(x: &Tensor, group: &Group) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(x.clone());
    }
    apply(x, x.detach(), Kind::Copy, group)
}

/// All-reduce (sum) forward, identity backward: joins the partial outputs of a row-parallel
/// layer.
pub fn reduce_from_group(x: &Tensor, group: &Group) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let sum = group.all_reduce(&x.detach().contiguous()?, ReduceOp::Sum)?;
    apply(x, sum, Kind::Reduce, group)
}

/// All-gather forward (the parts joined along `axis`, see [`super::assemble`] for `stride`),
/// own part backward: the whole output of a column-parallel layer on every rank.
pub fn gather_from_group(x: &Tensor, group: &Group, axis: usize, stride: usize) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let parts = group.all_gather(&x.detach().contiguous()?)?;
    let whole = assemble(&parts, axis, stride)?;
    apply(x, whole, Kind::Gather { axis, stride }, group)
}

/// Own part forward (see [`super::part`]), all-gather backward: splits a replicated tensor
/// for a row-parallel layer.
pub fn scatter_to_group(x: &Tensor, group: &Group, axis: usize, stride: usize) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let mine = part(&x.detach(), axis, stride, group.rank(), group.size())?;
    apply(x, mine, Kind::Scatter { axis, stride }, group)
}

/// The sum over the group of `x` `(batch, sequence, ...)`, member `r` keeping part `r` of the
/// sequence.
fn reduce_scatter_dim1(x: &Tensor, group: &Group) -> Result<Tensor> {
    let comm = group
        .comm()
        .ok_or_else(|| crate::invalid!("a reduce-scatter needs a group of more than one rank"))?;
    super::part_len(x.dim(1)?, 1, group.size())?;
    let y = comm.reduce_scatter(&x.transpose(0, 1)?.contiguous()?, ReduceOp::Sum)?;
    Ok(y.transpose(0, 1)?.contiguous()?)
}

/// Every member's `x` joined along dim 1 (the sequence) in rank order.
fn all_gather_dim1(x: &Tensor, group: &Group) -> Result<Tensor> {
    let parts = group.all_gather(&x.contiguous()?)?;
    let parts = parts
        .iter()
        .map(|p| p.to_device(x.device()))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 1)?)
}

/// All-gather along the sequence (dim 1) forward, reduce-scatter backward: a sequence-parallel
/// activation becomes the whole sequence for a column-parallel layer (whose ranks each add a
/// partial gradient for every position).
pub fn gather_sequence(x: &Tensor, group: &Group) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let whole = all_gather_dim1(&x.detach(), group)?;
    apply(x, whole, Kind::SeqGather, group)
}

/// Reduce-scatter along the sequence (dim 1) forward, all-gather backward: the partial outputs
/// of a row-parallel layer, summed, each member keeping its part of the sequence.
pub fn reduce_scatter_sequence(x: &Tensor, group: &Group) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(x.clone());
    }
    let mine = reduce_scatter_dim1(&x.detach(), group)?;
    apply(x, mine, Kind::SeqReduceScatter, group)
}
