//! 2-D convolution (candle's conv2d has a backward).

use candle_core::{Tensor, Var};

use super::{join, Module};
use crate::model::deferred::{WeightGradQueue, Work};
use crate::model::init::Init;
use crate::model::Cx;
use crate::{Error, Result};

/// A 2-D convolution over `(N, C, H, W)` with a bias (PyTorch's `Conv2d`), its weight gradient
/// deferred under a split backward.
#[derive(Clone, Debug)]
pub struct Conv2d {
    name: String,
    weight: Var,
    bias: Option<Var>,
    stride: usize,
    padding: usize,
    in_channels: usize,
}

impl Conv2d {
    /// Square `kernel`; PyTorch's default initialisation (uniform +-1/sqrt(fan_in)).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        init: &Init,
        name: &str,
        in_channels: usize,
        out_channels: usize,
        kernel: usize,
        stride: usize,
        padding: usize,
        bias: bool,
    ) -> Result<Self> {
        if in_channels == 0 || out_channels == 0 || kernel == 0 || stride == 0 {
            return Err(Error::Layer {
                layer: name.into(),
                msg: "channels, kernel and stride must be positive".into(),
            });
        }
        let fan_in = (in_channels * kernel * kernel) as f64;
        let bound = 1.0 / fan_in.sqrt();
        let weight = init.uniform(
            &join(name, "weight"),
            &[out_channels, in_channels, kernel, kernel],
            bound,
        )?;
        let bias = if bias {
            Some(init.uniform(&join(name, "bias"), &[out_channels], bound)?)
        } else {
            None
        };
        Ok(Self {
            name: name.to_string(),
            weight,
            bias,
            stride,
            padding,
            in_channels,
        })
    }

    /// [`Conv2d::forward`], or with its weight gradient deferred to `cx`'s queue.
    pub fn forward_cx(&self, x: &Tensor, cx: &Cx) -> Result<Tensor> {
        match &cx.weight_grads {
            None => self.forward(x),
            Some(q) => self.run(x, Some((q, cx.micro_batch))),
        }
    }

    /// `x`: `(batch, in_channels, h, w)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.run(x, None)
    }

    fn run(&self, x: &Tensor, defer: Option<(&WeightGradQueue, usize)>) -> Result<Tensor> {
        match x.dims() {
            [_, c, _, _] if *c == self.in_channels => {}
            d => {
                return Err(Error::Layer {
                    layer: self.name.clone(),
                    msg: format!("expects (batch, {}, h, w), got {d:?}", self.in_channels),
                })
            }
        }
        let y = match defer {
            None => x.conv2d(&self.weight, self.padding, self.stride, 1, 1)?,
            Some((q, mb)) => {
                let w = self.weight.as_tensor().detach();
                // No graph: the tap gives the input its gradient, and the kernel's waits.
                let y = x.detach().conv2d(&w, self.padding, self.stride, 1, 1)?;
                let (_, _, k0, k1) = w.dims4()?;
                let work = Work::Conv2d {
                    padding: self.padding,
                    stride: self.stride,
                    kernel: (k0, k1),
                };
                q.tap(
                    y,
                    x,
                    self.weight.as_tensor(),
                    None,
                    mb,
                    &join(&self.name, "weight"),
                    work,
                )?
            }
        };
        match &self.bias {
            Some(b) => Ok(y.broadcast_add(&b.reshape((1, b.dim(0)?, 1, 1))?)?),
            None => Ok(y),
        }
    }
}

impl Module for Conv2d {
    fn params(&self) -> Vec<(String, Var)> {
        let mut v = vec![(join(&self.name, "weight"), self.weight.clone())];
        if let Some(b) = &self.bias {
            v.push((join(&self.name, "bias"), b.clone()));
        }
        v
    }
}
