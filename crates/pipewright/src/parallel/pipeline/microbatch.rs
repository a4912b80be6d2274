//! Splitting activations into micro-batches and gathering outputs back (torchgpipe's
//! `microbatch.py`). Batches split with [`crate::model::batch::Batch::split`]; the row arithmetic
//! ([`chunk_sizes`], [`split`]) lives in [`crate::model::batch`], the one place both the pipeline and
//! the serial oracle take it from.

use candle_core::Tensor;

pub use crate::model::batch::{chunk_sizes, split};

use crate::model::Activation;
use crate::{invalid, Result};

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
