//! Element-wise activations and softmax, all with working gradients.

use candle_core::{Tensor, D};

use crate::{kernels, Result};

/// GELU, tanh approximation (GPT-2's `gelu_new`); fused forward and backward on the CPU and
/// (in the `cuda` build) on a GPU.
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    if kernels::fused_or_gpu(x) {
        return Ok(kernels::gelu::gelu(x)?);
    }
    Ok(x.gelu()?)
}

/// SwiGLU's gate `silu(gate) * up` (Llama's MLP, between its column- and row-parallel
/// layers): one fused kernel each way on the CPU and a GPU, composed ops elsewhere.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if kernels::fused_or_gpu(gate)
        && gate.dtype() == up.dtype()
        && up.device().same_device(gate.device())
    {
        return Ok(kernels::swiglu::swiglu(gate, up)?);
    }
    Ok((gate.silu()? * up)?)
}

/// `max(x, 0)`.
pub fn relu(x: &Tensor) -> Result<Tensor> {
    Ok(x.relu()?)
}

/// Softmax over the last dimension (fused forward and backward on the CPU). The row maximum
/// is subtracted for stability and detached: softmax is shift invariant, so the gradient is
/// exact.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    scaled_softmax(x, 1.0, false)
}

/// Causal self-attention of a packed `(batch, time, 3 * heads * head_dim)` q | k | v tensor
/// (heads contiguous within each third) in one fused op, giving `(batch, time, heads *
/// head_dim)`: no `(time x time)` tensor is kept for the backward, and on a GPU it runs flash
/// kernels (tensor cores for bf16 and f16). `None` where no fused kernel takes the tensor
/// (then compose [`scaled_softmax`] with the products).
pub fn fused_causal_attention(qkv: &Tensor, heads: usize, scale: f64) -> Result<Option<Tensor>> {
    if !kernels::attention::takes(qkv, heads) {
        return Ok(None);
    }
    Ok(Some(kernels::attention::causal_attention(
        qkv, heads, scale,
    )?))
}

/// `softmax(scale * x)` over the last dimension, `scale > 0`. `causal`: `x` is
/// `(..., queries, keys)` attention scores and query `i` sees keys `0..=i + keys - queries`
/// (the rest get probability zero), as GPT's masked self-attention. On the CPU one fused
/// kernel with a fused backward, and no mask tensor; elsewhere composed ops.
pub fn scaled_softmax(x: &Tensor, scale: f64, causal: bool) -> Result<Tensor> {
    if !(scale > 0.0 && scale.is_finite()) {
        return Err(crate::invalid!(
            "softmax scale must be positive and finite, got {scale}"
        ));
    }
    if kernels::fused(x) {
        return Ok(kernels::softmax::softmax(x, scale, causal)?);
    }
    let mut x = (x * scale)?;
    if causal {
        let (q, k) = (x.dim(D::Minus2)?, x.dim(D::Minus1)?);
        if k < q {
            return Err(crate::invalid!(
                "a causal softmax needs at least as many keys ({k}) as queries ({q})"
            ));
        }
        x = x.broadcast_add(&causal_mask(q, k, x.dtype(), x.device())?)?;
    }
    composed_softmax(&x)
}

/// `(queries, keys)` additive mask: query `i` sees keys `0..=i + keys - queries` (0 there,
/// -inf elsewhere).
pub fn causal_mask(
    queries: usize,
    keys: usize,
    dtype: candle_core::DType,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let off = keys - queries.min(keys);
    let m: Vec<f32> = (0..queries * keys)
        .map(|i| {
            if i % keys > i / keys + off {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Ok(
        Tensor::from_vec(m, (queries, keys), &candle_core::Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)?,
    )
}

fn composed_softmax(x: &Tensor) -> Result<Tensor> {
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
