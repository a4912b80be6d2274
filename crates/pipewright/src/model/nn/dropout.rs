//! Seeded dropout: the mask is a function of (run seed, step, micro-batch, site name), so the
//! same forward recomputed later, or run on another rank, draws the same mask.

use candle_core::Tensor;
use rand::Rng;

use crate::model::init::rng_for;
use crate::model::Cx;
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
        let mut whole = x.dims().to_vec();
        whole[axis] *= count;
        let key = format!("dropout/{}/{}/{}", self.site, cx.step, cx.micro_batch);
        let mut rng = rng_for(cx.seed, &key);
        let scale = 1.0 / (1.0 - self.p);
        let mask: Vec<f32> = (0..whole.iter().product::<usize>())
            .map(|_| {
                if rng.random::<f64>() < self.p {
                    0.0
                } else {
                    scale as f32
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, whole, &candle_core::Device::Cpu)?
            .narrow(axis, index * x.dim(axis)?, x.dim(axis)?)?
            .to_dtype(x.dtype())?
            .to_device(x.device())?;
        Ok((x * mask)?)
    }
}
