//! Rotary position embeddings (RoPE) as Hugging Face's Llama applies them: frequencies
//! `theta^(-2i/hd)` for the first half of a head's width, repeated over the second half, each
//! pair `(i, i + hd/2)` rotated by `position * frequency`. Angles in f32 as transformers
//! computes them.

use candle_core::{Tensor, D};

use crate::kernels::rotary::Angles;
use crate::{invalid, kernels, Result};

/// `x` `(batch, heads, t, head_dim)` with rotary embeddings of positions `start..start + t`
/// (`start` > 0 when decoding after cached tokens). One fused kernel each way on the CPU and
/// a GPU (the backward rotates back); composed ops elsewhere (`x cos + rotate_half(x) sin`).
pub fn rope(x: &Tensor, start: usize, theta: f64) -> Result<Tensor> {
    let (t, hd) = (x.dim(D::Minus2)?, x.dim(D::Minus1)?);
    if hd % 2 != 0 || !(theta > 0.0 && theta.is_finite()) {
        return Err(invalid!(
            "rotary embeddings need an even head width and a positive base, got {hd} and {theta}"
        ));
    }
    let angles = Angles::new(start, t, hd, theta);
    if kernels::fused_or_gpu(x) {
        return Ok(kernels::rotary::rope(x, angles)?);
    }
    let whole = |v: &[f32]| -> Result<Tensor> {
        let half = Tensor::from_slice(v, (t, hd / 2), x.device())?;
        Ok(Tensor::cat(&[&half, &half], D::Minus1)?.to_dtype(x.dtype())?)
    };
    let (cos, sin) = angles.tables();
    let (cos, sin) = (whole(cos)?, whole(sin)?);
    let (x1, x2) = (
        x.narrow(D::Minus1, 0, hd / 2)?,
        x.narrow(D::Minus1, hd / 2, hd / 2)?,
    );
    let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
    Ok((x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?)?)
}
