//! Layer normalisation over the last dimension.

use candle_core::{Tensor, Var, D};

use super::{join, Module};
use crate::model::init::Init;
use crate::{kernels, Result};

/// `(x - mean) / sqrt(var + eps) * weight + bias`, biased variance, as `torch.nn.LayerNorm`.
/// On the CPU and (in the `cuda` build) a GPU one fused kernel forward and one backward;
/// elsewhere composed ops.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    if kernels::fused_or_gpu(x) && weight.dtype() == x.dtype() && bias.dtype() == x.dtype() {
        return Ok(kernels::layer_norm::layer_norm(x, weight, bias, eps)?);
    }
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let xn = xc.broadcast_div(&(var + eps)?.sqrt()?)?;
    Ok(xn.broadcast_mul(weight)?.broadcast_add(bias)?)
}

/// Layer normalisation over the last dimension with a learned scale and shift (PyTorch's
/// `LayerNorm`).
#[derive(Clone, Debug)]
pub struct LayerNorm {
    name: String,
    weight: Var,
    bias: Var,
    eps: f64,
}

impl LayerNorm {
    /// Weight one, bias zero.
    pub fn new(init: &Init, name: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            name: name.to_string(),
            weight: init.constant(&[dim], 1.0)?,
            bias: init.constant(&[dim], 0.0)?,
            eps,
        })
    }

    /// Normalises `x` over its last dimension, then scales and shifts it.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, |w| Ok(w.clone()))
    }

    /// [`LayerNorm::forward`] with the weight and bias passed through `route` first (sequence
    /// parallelism routes them through an op that sums their gradients over a group).
    pub fn forward_with(
        &self,
        x: &Tensor,
        route: impl Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let (w, b) = (
            route(self.weight.as_tensor())?,
            route(self.bias.as_tensor())?,
        );
        layer_norm(x, &w, &b, self.eps)
    }
}

impl Module for LayerNorm {
    fn params(&self) -> Vec<(String, Var)> {
        vec![
            (join(&self.name, "weight"), self.weight.clone()),
            (join(&self.name, "bias"), self.bias.clone()),
        ]
    }
}
