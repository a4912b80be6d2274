//! Cross-entropy with an ignore index, computed so that micro-batches add up to the batch.

use candle_core::{DType, Tensor};

use super::activation::log_softmax_last_dim;
use crate::kernels::IGNORE_INDEX;
use crate::{invalid, kernels, Result};

/// Sum of the negative log-likelihoods of the non-ignored targets, and how many there are; in
/// f32 for f16 and bf16 logits.
///
/// `logits`: `(..., classes)`; `targets`: the same leading shape, integer class ids or
/// [`IGNORE_INDEX`]. Divide the sum by the count of the *whole* batch to get PyTorch's mean
/// reduction, also when the batch is processed in micro-batches.
pub fn cross_entropy_sum(logits: &Tensor, targets: &Tensor) -> Result<(Tensor, usize)> {
    let (classes, n) = class_rows(logits, targets)?;
    let t: Vec<i64> = targets.flatten_all()?.to_dtype(DType::I64)?.to_vec1()?;
    let mut count = 0usize;
    for &v in &t {
        if v == IGNORE_INDEX {
            continue;
        }
        if v < 0 || v as usize >= classes {
            return Err(invalid!(
                "cross-entropy: target {v} is outside 0..{classes} (use {IGNORE_INDEX} to ignore a position)"
            ));
        }
        count += 1;
    }
    if kernels::fused_or_gpu(logits) {
        let nll = kernels::cross_entropy::nll_rows(logits, t)?;
        return Ok((nll.sum_all()?, count));
    }
    let logits = &in_f32(logits)?;
    let kept = |v: i64| v != IGNORE_INDEX;
    let safe: Vec<u32> = t
        .iter()
        .map(|&v| if kept(v) { v as u32 } else { 0 })
        .collect();
    let mask: Vec<f32> = t.iter().map(|&v| f32::from(u8::from(kept(v)))).collect();
    let dev = logits.device();
    let logp = log_softmax_last_dim(&logits.reshape((n, classes))?)?;
    let idx = Tensor::from_vec(safe, (n, 1), dev)?;
    let picked = logp.gather(&idx, 1)?.squeeze(1)?;
    let mask = Tensor::from_vec(mask, n, dev)?.to_dtype(logits.dtype())?;
    Ok(((picked * mask)?.sum_all()?.neg()?, count))
}

/// `logits` in f32 when they are f16 or bf16 (the loss is computed in f32); as they are else.
pub(crate) fn in_f32(logits: &Tensor) -> Result<Tensor> {
    Ok(match logits.dtype() {
        DType::F16 | DType::BF16 => logits.to_dtype(DType::F32)?,
        _ => logits.clone(),
    })
}

/// The size of the class dimension of `logits` and how many rows of classes they hold, checked
/// against the number of `targets`.
pub fn class_rows(logits: &Tensor, targets: &Tensor) -> Result<(usize, usize)> {
    let classes = *logits
        .dims()
        .last()
        .ok_or_else(|| invalid!("cross-entropy needs logits with a class dimension"))?;
    let n = logits.elem_count() / classes.max(1);
    if targets.elem_count() != n {
        return Err(invalid!(
            "cross-entropy: logits {:?} hold {n} rows but targets {:?} hold {}",
            logits.dims(),
            targets.dims(),
            targets.elem_count()
        ));
    }
    Ok((classes, n))
}

/// Mean cross-entropy over the non-ignored targets (PyTorch's `F.cross_entropy`).
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (sum, count) = cross_entropy_sum(logits, targets)?;
    if count == 0 {
        return Err(invalid!("cross-entropy: every target is ignored"));
    }
    Ok((sum / count as f64)?)
}

/// Number of targets that are not [`IGNORE_INDEX`]: what [`cross_entropy_sum`] averages over.
pub fn count_targets(targets: &Tensor) -> Result<usize> {
    let t: Vec<i64> = targets.flatten_all()?.to_dtype(DType::I64)?.to_vec1()?;
    Ok(t.iter().filter(|&&v| v != IGNORE_INDEX).count())
}
