//! Profiling a model layer by layer on this machine (torchgpipe's `balance_by_time` and
//! `balance_by_size` profile the same way): one micro-batch goes through the layers in turn;
//! each layer's forward and backward are timed alone (its input a fresh variable, so the
//! backward stops at it), and its parameter and output bytes are counted.

use std::time::Instant;

use candle_core::{Tensor, Var};
use serde::Serialize;

use crate::batch::Batch;
use crate::model::{Activation, Build, Cx, Mode, Sequential};
use crate::Result;

/// What one layer costs for one micro-batch.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerCost {
    /// The layer's name.
    pub name: String,
    /// Seconds of its forward (the fastest of the repeats).
    pub forward_s: f64,
    /// Seconds of its backward (the fastest of the repeats).
    pub backward_s: f64,
    /// Bytes of its parameters.
    pub param_bytes: usize,
    /// Bytes of its output for the micro-batch.
    pub activation_bytes: usize,
}

impl LayerCost {
    /// Forward and backward seconds.
    pub fn time(&self) -> f64 {
        self.forward_s + self.backward_s
    }

    /// Bytes a stage keeps for the layer in training: parameters with their gradients and two
    /// optimizer moments (AdamW), and the output of one micro-batch.
    pub fn size(&self) -> f64 {
        (4 * self.param_bytes + self.activation_bytes) as f64
    }
}

fn bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// Profiles every layer of `model`, built by `build`, on the micro-batch `sample`: the fastest
/// of `repeats` timings of each layer's forward and backward.
pub fn profile_layers(
    model: &Sequential,
    build: &Build,
    sample: &Batch,
    repeats: usize,
) -> Result<Vec<LayerCost>> {
    let stage = model.build(build)?;
    let mut x = Activation::from_batch(sample, model.input_names(), "the model")?;
    let mut cx = Cx::new(Mode::Train, 0, 0, 0);
    let mut out = Vec::new();
    for layer in stage.layers() {
        let (mut forward_s, mut backward_s) = (f64::INFINITY, f64::INFINITY);
        let mut y = None;
        for _ in 0..repeats.max(1) {
            // A fresh leaf for every float input: the backward stops at this layer.
            let tuple = x.is_tuple();
            let inputs = x
                .tensors()
                .into_iter()
                .map(|t| {
                    Ok(if t.dtype().is_float() {
                        Var::from_tensor(&t.detach())?.as_tensor().clone()
                    } else {
                        t.clone()
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            // A stash a later layer pops stays for it (skip connections).
            let t0 = Instant::now();
            let got = layer.forward(Activation::from_tensors(inputs, tuple), &mut cx)?;
            let t1 = Instant::now();
            let mut objective: Option<Tensor> = None;
            for t in got.tensors().into_iter().filter(|t| t.dtype().is_float()) {
                let s = t.sum_all()?;
                objective = Some(match objective {
                    Some(o) => (o + s)?,
                    None => s,
                });
            }
            let t2 = Instant::now();
            if let Some(o) = objective {
                o.backward()?;
            }
            forward_s = forward_s.min((t1 - t0).as_secs_f64());
            backward_s = backward_s.min(t2.elapsed().as_secs_f64());
            y = Some(got);
        }
        let y = y.expect("at least one repeat");
        out.push(LayerCost {
            name: layer.name().to_string(),
            forward_s,
            backward_s,
            param_bytes: layer
                .params()
                .iter()
                .map(|(_, v)| bytes(v.as_tensor()))
                .sum(),
            activation_bytes: y.tensors().into_iter().map(bytes).sum(),
        });
        let tuple = y.is_tuple();
        let next = y.tensors().into_iter().map(|t| t.detach()).collect();
        x = Activation::from_tensors(next, tuple);
    }
    Ok(out)
}
