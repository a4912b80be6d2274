//! Tensor parallelism (TorchShard, Megatron): single layers split across the ranks of a
//! tensor-parallel group.
//!
//! - [`Group`]: the group a layer is split over (a size-1 group means "not split"); it
//!   travels in [`crate::model::Build`] beside the initialiser, so that a layer builds only its
//!   own shard.
//! - [`slice`](fn@slice): TorchShard's `slice`; [`part`] and [`assemble`] split and join along an axis,
//!   also "strided" axes such as GPT's fused q|k|v columns.
//! - [`ops`]: the collectives inside the layers, as autograd ops whose backward is the
//!   conjugate collective (copy <-> all-reduce, gather <-> scatter).
//! - [`layers`]: [`ParallelLinear`] (column, row or replicated) and [`ParallelEmbedding`].
//! - [`attention`]: GPT-2's causal self-attention with its heads split over the group.
//! - [`sequence`]: Megatron's sequence parallelism (activations between the parallel layers
//!   split along the sequence).
//! - [`loss`]: vocabulary-parallel cross-entropy that never forms the full vocabulary.
//! - [`attr`]: parallel-dim metadata of tensors and parameters ([`Shard`]).
//! - [`state`]: collect and relocate state dicts between sharded and whole form.
//!
//! Sizes must divide: a split axis that the group size does not divide is a clear error
//! naming the layer (TorchShard and Megatron do the same; pad the vocabulary to a multiple of
//! the group size).

pub mod attention;
pub mod attr;
pub mod layers;
pub mod loss;
pub mod ops;
pub mod sequence;
pub mod state;

use candle_core::Tensor;

use crate::{invalid, Result};

pub use crate::distributed::comm::Group;
pub use crate::model::Shard;
pub use attention::CausalSelfAttention;
pub use attr::{get_parallel_dim, register_parallel_attribute, register_parallel_dim};
pub use layers::{ParallelDim, ParallelEmbedding, ParallelLinear};
pub use loss::vocab_parallel_cross_entropy_sum;
pub use ops::{
    copy_to_group, gather_from_group, gather_sequence, reduce_from_group, reduce_scatter_sequence,
    scatter_to_group,
};
pub use sequence::SequenceParallel;
pub use state::{
    collect_state_dict, load_state_dict, register_ddp_parameters_to_ignore, relocate_state_dict,
    state_dict,
};

/// `dim` of a tensor of `rank` dimensions, negative counting from the end.
pub fn normalize_dim(dim: i64, rank: usize) -> Result<usize> {
    let d = if dim < 0 { dim + rank as i64 } else { dim };
    if d < 0 || d >= rank as i64 {
        return Err(invalid!(
            "dimension {dim} is outside a tensor of {rank} dimensions"
        ));
    }
    Ok(d as usize)
}

/// TorchShard's `slice`: `num_partitions` equal parts of `tensor` along `dim` (the tensor
/// itself, once, when `dim` is `None`), as `torch.split` returns them. With `contiguous` each
/// part is copied into its own contiguous memory. The size of `dim` must be a multiple of
/// `num_partitions`.
pub fn slice(
    tensor: &Tensor,
    num_partitions: usize,
    dim: Option<i64>,
    contiguous: bool,
) -> Result<Vec<Tensor>> {
    let Some(dim) = dim else {
        return Ok(vec![tensor.clone()]);
    };
    let axis = normalize_dim(dim, tensor.rank())?;
    (0..num_partitions)
        .map(|r| {
            let p = part(tensor, axis, 1, r, num_partitions)?;
            Ok(if contiguous { p.contiguous()? } else { p })
        })
        .collect()
}

/// Size of one part when `n` is split into `count` parts, each made of `stride` blocks.
pub fn part_len(n: usize, stride: usize, count: usize) -> Result<usize> {
    if count == 0 || stride == 0 || !n.is_multiple_of(stride * count) {
        return Err(invalid!(
            "a dimension of size {n} does not split into {count} equal parts{}: choose sizes \
             divisible by the tensor-parallel size",
            if stride > 1 {
                format!(" of {stride} blocks each")
            } else {
                String::new()
            }
        ));
    }
    Ok(n / (stride * count))
}

/// Part `index` of `count` of `t` along `axis`. With `stride` > 1 the axis is `stride` blocks
/// (GPT's q|k|v) and the part is the `index`-th piece of every block, in block order: the
/// layout Megatron calls a strided partition.
pub fn part(t: &Tensor, axis: usize, stride: usize, index: usize, count: usize) -> Result<Tensor> {
    let n = t.dim(axis)?;
    let m = part_len(n, stride, count)?;
    if index >= count {
        return Err(invalid!("part {index} of {count} does not exist"));
    }
    if stride == 1 {
        return Ok(t.narrow(axis, index * m, m)?);
    }
    let block = n / stride;
    let pieces = (0..stride)
        .map(|s| t.narrow(axis, s * block + index * m, m))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Ok(Tensor::cat(&pieces, axis)?)
}

/// Joins `parts` (as [`part`] made them, in index order) back into the whole along `axis`.
pub fn assemble(parts: &[Tensor], axis: usize, stride: usize) -> Result<Tensor> {
    if parts.is_empty() {
        return Err(invalid!("nothing to assemble"));
    }
    if stride == 1 {
        return Ok(Tensor::cat(parts, axis)?);
    }
    let m = part_len(parts[0].dim(axis)?, stride, 1)?;
    let mut pieces = Vec::with_capacity(stride * parts.len());
    for s in 0..stride {
        for p in parts {
            pieces.push(p.narrow(axis, s * m, m)?);
        }
    }
    Ok(Tensor::cat(&pieces, axis)?)
}

/// The whole model output: an output split over the tensor-parallel group (as the [`Cx`] of its
/// forward marks it) is gathered; a whole one is returned as it is.
///
/// [`Cx`]: crate::model::Cx
pub fn whole_output(out: &Tensor, cx: &crate::model::Cx, tp: &Group) -> Result<Tensor> {
    match cx.parallel_dim(out) {
        Some(d) if tp.size() > 1 => {
            let axis = normalize_dim(d, out.rank())?;
            Ok(Tensor::cat(&tp.all_gather(&out.contiguous()?)?, axis)?)
        }
        _ => Ok(out.clone()),
    }
}
