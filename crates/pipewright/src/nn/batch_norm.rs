//! BatchNorm2d with running statistics, PyTorch semantics.
//!
//! Training normalises with the batch's mean and biased variance and moves the running
//! statistics by `momentum` towards the batch mean and the *unbiased* variance. Evaluation
//! normalises with the running statistics. A recomputed forward (see
//! [`crate::model::Cx::is_recomputing`]) never moves the statistics a second time.

use candle_core::{Tensor, Var};

use super::{join, Init, Module};
use crate::model::Cx;
use crate::{Error, Result};

#[derive(Clone, Debug)]
pub struct BatchNorm2d {
    name: String,
    weight: Var,
    bias: Var,
    running_mean: Var,
    running_var: Var,
    eps: f64,
    momentum: f64,
    channels: usize,
}

impl BatchNorm2d {
    pub fn new(init: &Init, name: &str, channels: usize) -> Result<Self> {
        Ok(Self {
            name: name.to_string(),
            weight: init.constant(&[channels], 1.0)?,
            bias: init.constant(&[channels], 0.0)?,
            running_mean: init.constant(&[channels], 0.0)?,
            running_var: init.constant(&[channels], 1.0)?,
            eps: 1e-5,
            momentum: 0.1,
            channels,
        })
    }

    /// Batch mean and biased variance per channel, each `(1, c, 1, 1)`, and the count per
    /// channel.
    pub fn batch_stats(x: &Tensor) -> Result<(Tensor, Tensor, usize)> {
        let (b, c, h, w) = x.dims4()?;
        let n = b * h * w;
        let xt = x.transpose(0, 1)?.reshape((c, n))?;
        let mean = xt.mean_keepdim(1)?;
        let var = xt.broadcast_sub(&mean)?.sqr()?.mean_keepdim(1)?;
        Ok((mean.reshape((1, c, 1, 1))?, var.reshape((1, c, 1, 1))?, n))
    }

    /// Moves the running statistics towards (`mean`, biased `var` over `n` values).
    pub fn update_running(&self, mean: &Tensor, var: &Tensor, n: usize) -> Result<()> {
        let m = self.momentum;
        let unbiased = if n > 1 {
            (var.detach().flatten_all()? * (n as f64 / (n as f64 - 1.0)))?
        } else {
            var.detach().flatten_all()?
        };
        let rm =
            ((self.running_mean.as_tensor() * (1.0 - m))? + (mean.detach().flatten_all()? * m)?)?;
        let rv = ((self.running_var.as_tensor() * (1.0 - m))? + (unbiased * m)?)?;
        self.running_mean.set(&rm)?;
        self.running_var.set(&rv)?;
        Ok(())
    }

    pub fn forward(&self, x: &Tensor, cx: &Cx) -> Result<Tensor> {
        match x.dims() {
            [_, c, _, _] if *c == self.channels => {}
            d => {
                return Err(Error::Layer {
                    layer: self.name.clone(),
                    msg: format!("expects (batch, {}, h, w), got {d:?}", self.channels),
                })
            }
        }
        let c = self.channels;
        let (mean, var) = if cx.is_training() {
            let (mean, var, n) = Self::batch_stats(x)?;
            if !cx.is_recomputing() {
                self.update_running(&mean, &var, n)?;
            }
            (mean, var)
        } else {
            (
                self.running_mean.reshape((1, c, 1, 1))?,
                self.running_var.reshape((1, c, 1, 1))?,
            )
        };
        let xn = x
            .broadcast_sub(&mean)?
            .broadcast_div(&(var + self.eps)?.sqrt()?)?;
        Ok(xn
            .broadcast_mul(&self.weight.reshape((1, c, 1, 1))?)?
            .broadcast_add(&self.bias.reshape((1, c, 1, 1))?)?)
    }

    pub fn buffers(&self) -> Vec<(String, Var)> {
        vec![
            (join(&self.name, "running_mean"), self.running_mean.clone()),
            (join(&self.name, "running_var"), self.running_var.clone()),
        ]
    }
}

impl Module for BatchNorm2d {
    fn params(&self) -> Vec<(String, Var)> {
        vec![
            (join(&self.name, "weight"), self.weight.clone()),
            (join(&self.name, "bias"), self.bias.clone()),
        ]
    }
}
