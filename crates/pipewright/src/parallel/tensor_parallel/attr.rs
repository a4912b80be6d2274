//! Parallel-dim metadata (TorchShard's `_PARALLEL_DIM` and `_ORDER_TYPE` attributes): how a
//! tensor or a parameter is split over the tensor-parallel group, so that losses and state-dict
//! code treat it right.
//!
//! TorchShard's values: `-1` (or `1`): the output features are split ("column parallel"),
//! `0`: the input features are split ("row parallel"), `None`: whole. For a parameter the order
//! type says how the weight stores its features: `0` as `(out, in)`
//! ([`WeightLayout::OutIn`]), `1` as `(in, out)` ([`WeightLayout::InOut`]).
//!
//! Candle tensors carry no attributes, so an activation's parallel dim lives in the forward's
//! [`Cx`] (it is gone with the forward); a parameter's is a [`Shard`] its layer reports through
//! [`crate::Layer::shards`].

use super::{normalize_dim, part_len};
use crate::distributed::comm::Group;
use crate::model::{Cx, Shard, WeightLayout};
use crate::{invalid, Result};
use candle_core::Tensor;

/// TorchShard's `register_parallel_attribute` for a parameter: the [`Shard`] of this rank for a
/// parameter whose whole shape is `whole`, split on `parallel_dim` (`-1`/`1` output features,
/// `0` input features) with weights stored as `order`. One-dimensional parameters (biases)
/// have only output features. Fails when the split axis does not divide.
pub fn register_parallel_attribute(
    whole: &[usize],
    parallel_dim: i64,
    order: WeightLayout,
    stride: usize,
    group: &Group,
) -> Result<Shard> {
    let axis = match (whole.len(), parallel_dim, order) {
        (1, -1 | 1, _) => 0,
        (1, 0, _) => {
            return Err(invalid!(
                "a one-dimensional parameter has no input features to split (parallel dim 0)"
            ))
        }
        (2, -1 | 1, WeightLayout::OutIn) | (2, 0, WeightLayout::InOut) => 0,
        (2, -1 | 1, WeightLayout::InOut) | (2, 0, WeightLayout::OutIn) => 1,
        (n, d, _) => {
            return Err(invalid!(
            "parallel dim {d} of a parameter of {n} dimensions: use -1, 1 or 0 on a weight or bias"
        ))
        }
    };
    part_len(whole[axis], stride, group.size())?;
    Ok(Shard {
        parallel_dim: if parallel_dim == 1 { -1 } else { parallel_dim },
        order,
        axis,
        stride,
        index: group.rank(),
        count: group.size(),
        whole: whole.to_vec(),
    })
}

/// TorchShard's `register_parallel_dim` for an activation of this forward: `Some(-1)` says the
/// last dimension is split over the group, `None` clears the mark.
pub fn register_parallel_dim(cx: &mut Cx, t: &Tensor, parallel_dim: Option<i64>) -> Result<()> {
    if let Some(d) = parallel_dim {
        normalize_dim(d, t.rank())?;
    }
    cx.set_parallel_dim(t, parallel_dim);
    Ok(())
}

/// TorchShard's `get_parallel_dim` for an activation of this forward (`None`: whole).
pub fn get_parallel_dim(cx: &Cx, t: &Tensor) -> Option<i64> {
    cx.parallel_dim(t)
}
