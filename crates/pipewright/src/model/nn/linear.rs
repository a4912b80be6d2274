//! Fully connected layer.

use candle_core::{Tensor, Var};

use super::{join, Module};
use crate::model::deferred::{WeightGradQueue, Work};
use crate::model::init::Init;
use crate::model::Cx;
use crate::model::WeightLayout;
use crate::{model::kernels, Error, Result};

/// `y = x W^T + b` over the last dimension; any leading dimensions.
#[derive(Clone, Debug)]
pub struct Linear {
    name: String,
    weight: Var,
    bias: Option<Var>,
    layout: WeightLayout,
    in_features: usize,
    out_features: usize,
    /// Outputs whose bias cannot change the model's output (see [`Linear::inert_bias`]).
    inert_bias: Option<std::ops::Range<usize>>,
    /// GELU applied to the input first (see [`Linear::gelu_input`]).
    gelu_input: bool,
}

impl Linear {
    /// PyTorch's default initialisation: uniform(+-1/sqrt(in)) for weight and bias.
    pub fn new(init: &Init, name: &str, inp: usize, out: usize, bias: bool) -> Result<Self> {
        let bound = 1.0 / (inp as f64).sqrt();
        let w = init.uniform(&join(name, "weight"), &[out, inp], bound)?;
        let b = if bias {
            Some(init.uniform(&join(name, "bias"), &[out], bound)?)
        } else {
            None
        };
        Self::from_vars(name, w, b, WeightLayout::OutIn)
    }

    /// Normal(0, std) weight and zero bias, stored `(in, out)` as GPT-2's `Conv1D`.
    pub fn conv1d(init: &Init, name: &str, inp: usize, out: usize, std: f64) -> Result<Self> {
        let w = init.normal(&join(name, "weight"), &[inp, out], std)?;
        let b = init.constant(&[out], 0.0)?;
        Self::from_vars(name, w, Some(b), WeightLayout::InOut)
    }

    /// A linear layer from existing variables.
    pub fn from_vars(
        name: &str,
        weight: Var,
        bias: Option<Var>,
        layout: WeightLayout,
    ) -> Result<Self> {
        let (a, b) = weight.dims2()?;
        let (inp, out) = match layout {
            WeightLayout::OutIn => (b, a),
            WeightLayout::InOut => (a, b),
        };
        if let Some(bias) = &bias {
            if bias.dims() != [out] {
                return Err(Error::Layer {
                    layer: name.into(),
                    msg: format!("bias shape {:?} does not match {out} outputs", bias.dims()),
                });
            }
        }
        Ok(Self {
            name: name.to_string(),
            weight,
            bias,
            layout,
            in_features: inp,
            out_features: out,
            inert_bias: None,
            gelu_input: false,
        })
    }

    /// The weight, stored as [`Linear::layout`] says.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// Declares that the bias of `outputs` cannot change what the model computes, so its exact
    /// gradient is zero: attention's key bias, which shifts every score of a query's row by
    /// the same amount, and softmax ignores such shifts. That part of the bias is added as a
    /// constant, so its gradient is an exact zero rather than rounding noise (which AdamW,
    /// dividing by the noise's own size, would turn into full-size steps that differ between
    /// any two ways of summing the same numbers).
    pub fn inert_bias(mut self, outputs: std::ops::Range<usize>) -> Self {
        self.inert_bias = Some(outputs);
        self
    }

    /// Applies GPT-2's GELU (tanh form) to the input before the product: `gelu(x) W + b`, the
    /// second layer of a transformer's MLP with its activation folded in. On the CPU the
    /// activation is computed inside the fused product and never stored (the backward computes
    /// it again with its slope); elsewhere it is [`crate::model::nn::gelu`] then the product.
    pub fn gelu_input(mut self) -> Self {
        self.gelu_input = true;
        self
    }

    /// The bias, if any.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }

    /// How the weight stores its features.
    pub fn layout(&self) -> WeightLayout {
        self.layout
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Input features.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// [`Linear::forward`], or with its weight gradient deferred to `cx`'s queue.
    pub fn forward_cx(&self, x: &Tensor, cx: &Cx) -> Result<Tensor> {
        match &cx.weight_grads {
            None => self.forward(x),
            Some(q) => self.run(x, Some((q, cx.micro_batch))),
        }
    }

    /// `x W^T + b` over the last dimension of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.run(x, None)
    }

    fn run(&self, x: &Tensor, defer: Option<(&WeightGradQueue, usize)>) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        if dims.last() != Some(&self.in_features) {
            return Err(Error::Layer {
                layer: self.name.clone(),
                msg: format!(
                    "expects last dimension {}, got input of shape {dims:?}",
                    self.in_features
                ),
            });
        }
        let bias = self.bias_tensor()?;
        let out_in = self.layout == WeightLayout::OutIn;
        if kernels::fused(x)
            && self.weight.dtype() == x.dtype()
            && bias.as_ref().is_none_or(|b| b.dtype() == x.dtype())
        {
            let w = self.weight.as_tensor();
            let Some((q, mb)) = defer else {
                return Ok(kernels::linear::linear(
                    x,
                    w,
                    bias.as_ref(),
                    out_in,
                    self.gelu_input,
                )?);
            };
            return self.deferred_fused(x, bias.as_ref(), (q, mb));
        }
        let activated;
        let x = if self.gelu_input {
            activated = super::gelu(x)?;
            &activated
        } else {
            x
        };
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let x2 = x.reshape((rows, self.in_features))?;
        let weight = match defer {
            Some(_) => self.weight.as_tensor().detach(),
            None => self.weight.as_tensor().clone(),
        };
        let w = match self.layout {
            WeightLayout::OutIn => weight.t()?,
            WeightLayout::InOut => weight,
        };
        let mut y = match defer {
            // No graph: the tap gives the input its gradient, and the weight's waits.
            Some(_) => x2.detach().matmul(&w)?,
            None => x2.matmul(&w)?,
        };
        if let Some((q, mb)) = defer {
            let work = Work::Matmul {
                layout: self.layout,
                gelu: false,
            };
            y = q.tap(
                y,
                &x2,
                self.weight.as_tensor(),
                None,
                mb,
                &join(&self.name, "weight"),
                work,
            )?;
        }
        if let Some(b) = &bias {
            y = add_bias(&y, b)?;
        }
        let mut out_dims = dims;
        *out_dims.last_mut().unwrap() = self.out_features;
        Ok(y.reshape(out_dims)?)
    }

    /// The fused product (bias and GELU of the input inside, as the undeferred forward
    /// computes it) with no graph, tapped so the input and the bias get their gradients in the
    /// input pass and the weight's waits in `q`: the graph keeps the input and the output only,
    /// as the fused linear's does, where a bias added after the tap and a GELU computed before
    /// it kept three more tensors (a GPT block's deferred forward held 1.8 times its fused one).
    fn deferred_fused(
        &self,
        x: &Tensor,
        bias: Option<&Tensor>,
        (q, mb): (&WeightGradQueue, usize),
    ) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let x2 = x.reshape((rows, self.in_features))?;
        let w = self.weight.as_tensor();
        let out_in = self.layout == WeightLayout::OutIn;
        let y = kernels::linear::linear(
            &x2.detach(),
            &w.detach(),
            bias.map(Tensor::detach).as_ref(),
            out_in,
            self.gelu_input,
        )?;
        let work = Work::Matmul {
            layout: self.layout,
            gelu: self.gelu_input,
        };
        let name = join(&self.name, "weight");
        let y = q.tap(y, &x2, w, bias, mb, &name, work)?;
        let mut out_dims = dims;
        *out_dims.last_mut().unwrap() = self.out_features;
        Ok(y.reshape(out_dims)?)
    }

    /// The bias as the output adds it: with the inert part (see [`Linear::inert_bias`]) a
    /// constant, so its gradient is an exact zero.
    fn bias_tensor(&self) -> Result<Option<Tensor>> {
        let Some(b) = &self.bias else { return Ok(None) };
        let b = b.as_tensor();
        Ok(Some(match &self.inert_bias {
            Some(r) if !r.is_empty() => {
                let n = self.out_features;
                let parts = [
                    b.narrow(0, 0, r.start)?,
                    b.narrow(0, r.start, r.len())?.detach(),
                    b.narrow(0, r.end, n - r.end)?,
                ];
                Tensor::cat(&parts, 0)?
            }
            _ => b.clone(),
        }))
    }
}

/// `y + b` on every row: on the CPU and a GPU a fused op whose backward sums the bias gradient
/// over contiguous rows (on the CPU, the deferred weight-gradient path, whose product stays
/// separate).
pub(crate) fn add_bias(y: &Tensor, b: &Tensor) -> Result<Tensor> {
    if kernels::fused_or_gpu(y) && b.dtype() == y.dtype() {
        return Ok(kernels::bias::bias_add(y, b)?);
    }
    Ok(y.broadcast_add(b)?)
}

impl Module for Linear {
    fn params(&self) -> Vec<(String, Var)> {
        let mut v = vec![(join(&self.name, "weight"), self.weight.clone())];
        if let Some(b) = &self.bias {
            v.push((join(&self.name, "bias"), b.clone()));
        }
        v
    }
}
