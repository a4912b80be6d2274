//! Element-wise activations and softmax, all with working gradients.

use candle_core::{Tensor, D};

use crate::Result;

/// GELU, tanh approximation (GPT-2's `gelu_new`).
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    Ok(x.gelu()?)
}

pub fn relu(x: &Tensor) -> Result<Tensor> {
    Ok(x.relu()?)
}

/// Softmax over the last dimension. The row maximum is subtracted for stability and detached:
/// softmax is shift invariant, so the gradient is exact.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    let e = x.broadcast_sub(&m)?.exp()?;
    Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
}

/// Log-softmax over the last dimension.
pub fn log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let m = x.max_keepdim(D::Minus1)?.detach();
    let shifted = x.broadcast_sub(&m)?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    Ok(shifted.broadcast_sub(&lse)?)
}

/// A residual connection `x + f(x)`.
pub fn residual(x: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    let y = f(x)?;
    Ok((x + y)?)
}
