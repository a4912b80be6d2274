//! Seeded dropout: the mask is a function of (run seed, step, micro-batch, site name), so the
//! same forward recomputed later, or run on another rank, draws the same mask. Each element's
//! draw is computed on its own where the tensor is (`kernels::dropout`: the CPU and a GPU draw
//! the same mask), and the backward draws it again rather than keeping it.

use candle_core::{DType, Device, Tensor};

use crate::kernels;
use crate::model::Cx;
use crate::runtime::seed::hash_seed;
use crate::Result;

/// Dropout (PyTorch's `Dropout`): in training, each element is zeroed with probability `p` and the
/// rest scaled by `1 / (1 - p)`, with masks seeded by the step, micro-batch and layer.
#[derive(Clone, Debug)]
pub struct Dropout {
    site: String,
    p: f64,
}

impl Dropout {
    /// `site` names this dropout uniquely in the model (`h.3.attn.resid_dropout`).
    pub fn new(site: &str, p: f64) -> Self {
        Self {
            site: site.to_string(),
            p,
        }
    }

    /// Whether [`Dropout::forward`] changes anything in `cx` (p > 0 and training).
    pub fn is_active(&self, cx: &Cx) -> bool {
        self.p != 0.0 && cx.is_training()
    }

    /// Drops and scales `x` in training (seeded by `cx`); `x` itself in evaluation.
    pub fn forward(&self, x: &Tensor, cx: &Cx) -> Result<Tensor> {
        self.forward_part(x, cx, 0, 0, 1)
    }

    /// Dropout on part `index` of `count` along `axis` of a tensor split over a tensor-parallel
    /// group: the mask is the part of the whole tensor's mask, so a split run drops exactly
    /// what a serial run drops.
    pub fn forward_part(
        &self,
        x: &Tensor,
        cx: &Cx,
        axis: usize,
        index: usize,
        count: usize,
    ) -> Result<Tensor> {
        if !self.is_active(cx) {
            return Ok(x.clone());
        }
        let site = format!("dropout/{}/{}/{}", self.site, cx.step, cx.micro_batch);
        let key = hash_seed(&[&cx.seed.to_le_bytes(), site.as_bytes()]);
        let part = (axis, index, count);
        if kernels::fused_or_gpu(x) {
            return Ok(kernels::dropout::dropout(x, self.p, key, part)?);
        }
        // Other types and devices: the same mask drawn on the CPU, carried over and multiplied.
        let ones = Tensor::ones(x.dims(), DType::F32, &Device::Cpu)?;
        let mask = kernels::dropout::dropout(&ones, self.p, key, part)?
            .to_dtype(x.dtype())?
            .to_device(x.device())?;
        Ok((x * mask)?)
    }
}
