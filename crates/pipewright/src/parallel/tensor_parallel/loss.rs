//! Cross-entropy over logits whose classes (the vocabulary) are split over the tensor-parallel
//! group, computed without ever forming the whole vocabulary (Megatron's
//! `vocab_parallel_cross_entropy`): the row maximum, the target's logit and the sum of
//! exponentials are all-reduced as one number per row (on the CPU the sum and the target's
//! logit come from one fused kernel, forward and backward).

use candle_core::{DType, Tensor, D};

use super::ops::reduce_from_group;
use crate::distributed::comm::Group;
use crate::distributed::comm::ReduceOp;
use crate::kernels::IGNORE_INDEX;
use crate::model::nn::loss::{class_rows, in_f32};
use crate::{invalid, kernels, Result};

/// Sum of the negative log-likelihoods of the non-ignored targets and their count (in f32 for
/// f16 and bf16 logits), where
/// `logits` `(..., classes / T)` hold this rank's contiguous range of classes (rank `r` holds
/// classes `r * classes/T ..`). Equal on every rank of the group; the backward gives each rank
/// the gradient of its own logits.
pub fn vocab_parallel_cross_entropy_sum(
    logits: &Tensor,
    targets: &Tensor,
    group: &Group,
) -> Result<(Tensor, usize)> {
    let logits = &in_f32(logits)?;
    let (part, n) = class_rows(logits, targets)?;
    let classes = part * group.size();
    let start = part * group.rank();
    let t: Vec<i64> = targets.flatten_all()?.to_dtype(DType::I64)?.to_vec1()?;
    let mut count = 0usize;
    // Each row's target as an index into this rank's part of the classes, if it is there.
    let mut mine: Vec<Option<usize>> = Vec::with_capacity(n);
    let mut counted = Vec::with_capacity(n);
    for &v in &t {
        if v == IGNORE_INDEX {
            mine.push(None);
            counted.push(0f32);
            continue;
        }
        if v < 0 || v as usize >= classes {
            return Err(invalid!(
                "cross-entropy: target {v} is outside 0..{classes} (use {IGNORE_INDEX} to ignore a position)"
            ));
        }
        let v = v as usize;
        mine.push((start..start + part).contains(&v).then(|| v - start));
        counted.push(1.0);
        count += 1;
    }
    let dev = logits.device();
    let dt = logits.dtype();
    let z = logits.reshape((n, part))?;
    // The shift cancels in the loss and its gradient: a constant.
    let m = group.all_reduce(&z.max_keepdim(D::Minus1)?.detach(), ReduceOp::Max)?;
    let counted = Tensor::from_vec(counted, n, dev)?.to_dtype(dt)?;
    if kernels::fused(&z) {
        let pairs = reduce_from_group(&kernels::cross_entropy::partial_sums(&z, &m, mine)?, group)?;
        let nll = (pairs.narrow(1, 0, 1)?.log()? - pairs.narrow(1, 1, 1)?)?.squeeze(1)?;
        return Ok(((nll * counted)?.sum_all()?, count));
    }
    let shifted = z.broadcast_sub(&m)?;
    let sum_exp = reduce_from_group(&shifted.exp()?.sum_keepdim(D::Minus1)?, group)?;
    let local: Vec<u32> = mine.iter().map(|j| j.unwrap_or(0) as u32).collect();
    let here: Vec<f32> = mine
        .iter()
        .map(|j| f32::from(u8::from(j.is_some())))
        .collect();
    let idx = Tensor::from_vec(local, (n, 1), dev)?;
    let here = Tensor::from_vec(here, (n, 1), dev)?.to_dtype(dt)?;
    let target = reduce_from_group(&(shifted.gather(&idx, 1)? * here)?, group)?;
    let nll = (sum_exp.log()? - target)?.squeeze(1)?;
    Ok(((nll * counted)?.sum_all()?, count))
}
