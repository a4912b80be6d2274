//! Root-mean-square normalisation over the last dimension (Llama's RMSNorm).

use candle_core::{DType, Tensor, Var, D};

use super::{join, Module};
use crate::model::init::Init;
use crate::{kernels, Result};

/// `x / sqrt(mean(x^2) + eps) * weight`, as Hugging Face's `LlamaRMSNorm` computes it (the
/// normalisation in f32 whatever the input's type). On the CPU and a GPU one fused kernel
/// forward and one backward (in f32, rounded once); elsewhere composed ops.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    if kernels::fused_or_gpu(x)
        && weight.dtype() == x.dtype()
        && weight.device().same_device(x.device())
    {
        return Ok(kernels::rms_norm::rms_norm(x, weight, eps)?);
    }
    let dt = x.dtype();
    let x = x.to_dtype(DType::F32)?;
    let rms = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?;
    Ok(x.broadcast_div(&rms)?.to_dtype(dt)?.broadcast_mul(weight)?)
}

/// RMSNorm with a learned gain (ones at the start).
#[derive(Clone, Debug)]
pub struct RmsNorm {
    name: String,
    weight: Var,
    eps: f64,
}

impl RmsNorm {
    /// A gain of ones over `dim` channels.
    pub fn new(init: &Init, name: &str, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            name: name.to_string(),
            weight: init.constant(&[dim], 1.0)?,
            eps,
        })
    }

    /// Normalises `x` over its last dimension and scales it.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, |w| Ok(w.clone()))
    }

    /// [`RmsNorm::forward`] with the gain passed through `route` first (sequence parallelism
    /// routes it through an op that sums its gradient over a group).
    pub fn forward_with(
        &self,
        x: &Tensor,
        route: impl Fn(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        rms_norm(x, &route(self.weight.as_tensor())?, self.eps)
    }

    /// The layer's name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Module for RmsNorm {
    fn params(&self) -> Vec<(String, Var)> {
        vec![(join(&self.name, "weight"), self.weight.clone())]
    }
}
