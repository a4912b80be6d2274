//! BatchNorm2d with running statistics, PyTorch semantics.
//!
//! Training normalises with the batch's mean and biased variance and moves the running
//! statistics by `momentum` towards the batch mean and the *unbiased* variance. Evaluation
//! normalises with the running statistics. A recomputed forward (see
//! [`crate::model::Cx::is_recomputing`]) never moves the statistics a second time.
//!
//! Deferred (torchgpipe's `DeferredBatchNorm`, on when [`Cx::defer_batch_stats`] is set): each
//! micro-batch is still normalised with its own statistics, but the running statistics move
//! once per batch, at [`BatchNorm2d::finish_batch`], with the moments of the whole batch.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Tensor, Var};

use super::{join, Module};
use crate::model::init::Init;
use crate::model::Cx;
use crate::{Error, Result};

/// Batch normalisation over the channels of `(N, C, H, W)` (PyTorch's `BatchNorm2d`): batch
/// statistics in training (moving the running ones), running statistics in evaluation.
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
    /// Deferred moments of the batch so far: per-channel sum, sum of squares (f64), count.
    pending: Arc<Mutex<Option<(Tensor, Tensor, usize)>>>,
}

impl BatchNorm2d {
    /// A layer `name` over `channels` channels: weight 1, bias 0, running mean 0 and variance 1.
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
            pending: Arc::new(Mutex::new(None)),
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

    /// Normalises `x` as `cx`'s mode says (see the type's text).
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
            if cx.is_recomputing() {
                // Counted when first computed.
            } else if cx.defer_batch_stats {
                self.defer(x)?;
            } else {
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

    /// Adds a micro-batch's per-channel moments to the batch's.
    fn defer(&self, x: &Tensor) -> Result<()> {
        let (b, c, h, w) = x.dims4()?;
        let xt = x
            .detach()
            .to_dtype(DType::F64)?
            .transpose(0, 1)?
            .reshape((c, b * h * w))?;
        let (sum, sq) = (xt.sum(1)?, xt.sqr()?.sum(1)?);
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        *p = Some(match p.take() {
            Some((s0, q0, n0)) => ((s0 + sum)?, (q0 + sq)?, n0 + b * h * w),
            None => (sum, sq, b * h * w),
        });
        Ok(())
    }

    /// Commits deferred statistics: the running statistics move once, with the moments of
    /// every micro-batch seen since the last commit.
    pub fn finish_batch(&self) -> Result<()> {
        let Some((sum, sq, n)) = self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        else {
            return Ok(());
        };
        let mean = (sum / n as f64)?;
        let var = ((sq / n as f64)? - mean.sqr()?)?;
        let dt = self.running_mean.dtype();
        self.update_running(&mean.to_dtype(dt)?, &var.to_dtype(dt)?, n)
    }

    /// The running mean and variance, with their global names.
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
