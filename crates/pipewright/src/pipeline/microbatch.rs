//! Splitting a batch into micro-batches and gathering outputs back (torchgpipe's
//! `microbatch.py`).

use candle_core::Tensor;

use crate::model::Activation;
use crate::{invalid, Result};

/// Sizes of the micro-batches of a batch of `batch` rows split into at most `chunks`:
/// `torch.chunk` semantics, every chunk `ceil(batch / chunks)` rows but the last, so there may
/// be fewer than `chunks` of them.
pub fn chunk_sizes(batch: usize, chunks: usize) -> Result<Vec<usize>> {
    if chunks == 0 {
        return Err(invalid!("chunks must be at least 1"));
    }
    if batch == 0 {
        return Err(invalid!("cannot split an empty batch into micro-batches"));
    }
    let size = batch.div_ceil(chunks);
    let mut out = Vec::new();
    let mut left = batch;
    while left > 0 {
        let s = size.min(left);
        out.push(s);
        left -= s;
    }
    Ok(out)
}

/// Splits `t` along dim 0 into micro-batches of [`chunk_sizes`].
pub fn split(t: &Tensor, chunks: usize) -> Result<Vec<Tensor>> {
    let b = t
        .dims()
        .first()
        .copied()
        .ok_or_else(|| invalid!("a 0-d tensor has no batch dimension to split"))?;
    let mut start = 0;
    chunk_sizes(b, chunks)?
        .into_iter()
        .map(|s| {
            let c = t.narrow(0, start, s)?;
            start += s;
            Ok(c)
        })
        .collect()
}

/// Splits every tensor of an activation the same way; all must share the batch size.
pub fn split_activation(x: &Activation, chunks: usize) -> Result<Vec<Activation>> {
    match x {
        Activation::Tensor(t) => Ok(split(t, chunks)?
            .into_iter()
            .map(Activation::Tensor)
            .collect()),
        Activation::Tuple(ts) => {
            let b = x.batch_size()?;
            if let Some(bad) = ts.iter().find(|t| t.dims().first() != Some(&b)) {
                return Err(invalid!(
                    "every tensor of a tuple must have batch size {b} on dim 0, one has shape {:?}",
                    bad.dims()
                ));
            }
            let parts = ts
                .iter()
                .map(|t| split(t, chunks))
                .collect::<Result<Vec<_>>>()?;
            let n = parts[0].len();
            Ok((0..n)
                .map(|i| Activation::Tuple(parts.iter().map(|p| p[i].clone()).collect()))
                .collect())
        }
    }
}

/// Concatenates micro-batch outputs back into one batch.
pub fn gather(parts: &[Tensor]) -> Result<Tensor> {
    Ok(Tensor::cat(parts, 0)?)
}
