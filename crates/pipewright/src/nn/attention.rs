//! Causal multi-head self-attention (GPT-2), with explicit softmax so gradients flow.

use candle_core::{Device, Tensor, Var};

use super::{join, softmax_last_dim, Dropout, Init, Linear, Module};
use crate::model::Cx;
use crate::{Error, Result};

/// GPT-2 attention: `c_attn` projects to q, k, v (one `(d, 3d)` matrix), heads attend causally,
/// `c_proj` projects back. Parameter names follow Hugging Face GPT-2.
#[derive(Clone, Debug)]
pub struct CausalSelfAttention {
    name: String,
    c_attn: Linear,
    c_proj: Linear,
    attn_dropout: Dropout,
    resid_dropout: Dropout,
    n_head: usize,
}

impl CausalSelfAttention {
    /// `proj_std` is the std of `c_proj` (GPT-2 scales it by 1/sqrt(2 n_layer)).
    pub fn new(
        init: &Init,
        name: &str,
        n_embd: usize,
        n_head: usize,
        dropout: f64,
        proj_std: f64,
    ) -> Result<Self> {
        if n_head == 0 || !n_embd.is_multiple_of(n_head) {
            return Err(Error::Layer {
                layer: name.into(),
                msg: format!("n_embd {n_embd} must be a multiple of n_head {n_head}"),
            });
        }
        Ok(Self {
            name: name.to_string(),
            c_attn: Linear::conv1d(init, &join(name, "c_attn"), n_embd, 3 * n_embd, 0.02)?,
            c_proj: Linear::conv1d(init, &join(name, "c_proj"), n_embd, n_embd, proj_std)?,
            attn_dropout: Dropout::new(&join(name, "attn_dropout"), dropout),
            resid_dropout: Dropout::new(&join(name, "resid_dropout"), dropout),
            n_head,
        })
    }

    /// `x`: `(batch, time, n_embd)`.
    pub fn forward(&self, x: &Tensor, cx: &Cx) -> Result<Tensor> {
        let (b, t, c) = x.dims3().map_err(|_| Error::Layer {
            layer: self.name.clone(),
            msg: format!("expects (batch, time, channels), got {:?}", x.dims()),
        })?;
        let hd = c / self.n_head;
        let qkv = self.c_attn.forward_cx(x, cx)?;
        let heads = |i: usize| -> Result<Tensor> {
            Ok(qkv
                .narrow(2, i * c, c)?
                .reshape((b, t, self.n_head, hd))?
                .transpose(1, 2)?
                .contiguous()?)
        };
        let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
        let scale = 1.0 / (hd as f64).sqrt();
        let att = (q.matmul(&k.t()?)? * scale)?;
        let att = att.broadcast_add(&causal_mask(t, x.dtype(), x.device())?)?;
        let att = softmax_last_dim(&att)?;
        let att = self.attn_dropout.forward(&att, cx)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?;
        let y = self.c_proj.forward_cx(&y, cx)?;
        self.resid_dropout.forward(&y, cx)
    }
}

/// `(t, t)` additive mask: 0 on and below the diagonal, -inf above.
pub fn causal_mask(t: usize, dtype: candle_core::DType, device: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t > i / t {
                f32::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    Ok(Tensor::from_vec(m, (t, t), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?)
}

impl Module for CausalSelfAttention {
    fn params(&self) -> Vec<(String, Var)> {
        let mut v = self.c_attn.params();
        v.extend(self.c_proj.params());
        v
    }
}
