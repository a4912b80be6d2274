//! Profiling a model layer by layer on this machine (torchgpipe's `balance_by_time` and
//! `balance_by_size` profile the same way): one micro-batch goes forward through the layers in
//! turn and back in reverse, as a stage runs it; each layer's forward and backward are timed
//! on their own (its input a fresh variable, so the backward stops at it), and its parameter
//! and output bytes are counted.

use std::time::Instant;

use candle_core::DType;
use serde::Serialize;

use super::layer_pass::{bytes, fresh, Forwarded, Pass};
use crate::distributed::comm::Group;
use crate::model::batch::Batch;
use crate::model::{Activation, Build, Cx, Mode, Sequential, Stage};
use crate::parallel::loss::Loss;
use crate::Result;

/// What one layer costs for one micro-batch.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LayerCost {
    /// The layer's name.
    pub name: String,
    /// Seconds of its forward (the median of the repeats).
    pub forward_s: f64,
    /// Seconds of its backward (the median of the repeats).
    pub backward_s: f64,
    /// Seconds of its split backward's input gradients (zero-bubble schedules) ...
    pub backward_input_s: f64,
    /// ... and of its deferred weight gradients.
    pub backward_weight_s: f64,
    /// CPU seconds of its forward and backward (the median of the repeats), where the
    /// thread's clock can be read: less than their time by what its collectives wait.
    pub cpu_s: Option<f64>,
    /// Bytes of its parameters.
    pub param_bytes: usize,
    /// Bytes of its output for the micro-batch.
    pub activation_bytes: usize,
    /// Bytes its forward keeps for the backward (every tensor of its autograd graph but its
    /// parameters and input, each storage counted once).
    pub kept_bytes: usize,
    /// Bytes its forward keeps for the zero-bubble split backward (which runs the plain ops
    /// where the whole backward has fused kernels): as the allocator counts them when
    /// [`crate::runtime::memory::CountingAlloc`] is installed, else the graph's as above.
    pub split_kept_bytes: usize,
    /// Bytes the split backward holds from its input pass until its weight pass, once the
    /// graph is gone (the queue's inputs and output gradients): as the allocator counts them
    /// when it is installed, else the queued output gradients.
    pub deferred_bytes: usize,
    /// With [`crate::runtime::memory::CountingAlloc`] installed: the most its backward held at once
    /// beyond what it started with and its parameters' gradients, and of that what its
    /// gradient store still held when it ended, beyond its input's gradient ...
    pub backward_transient_bytes: Option<(usize, usize)>,
    /// ... and the same of its split backward's input pass, beyond what it keeps for the
    /// weight gradients.
    pub input_transient_bytes: Option<(usize, usize)>,
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

/// Seconds of the loss after the last layer, forward and backward, as the last pipeline
/// stage runs it on a micro-batch: the output in f32, the summed loss over the rows, read as a
/// number (the pipeline adds it up in f64), and its backward to the output.
fn loss_pass(
    loss: &dyn Loss,
    y: &Activation,
    batch: &Batch,
    cx: &mut Cx,
    tp: &Group,
) -> Result<(f64, f64)> {
    let out = Activation::from_tensors(fresh(y, cx)?, y.is_tuple());
    let t0 = Instant::now();
    let out = loss.input(out, cx)?;
    let (sum, _) = loss.sum(&out, batch, cx, tp)?;
    let mean = (sum / batch.rows()? as f64)?;
    mean.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let forward_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    mean.backward()?;
    Ok((forward_s, t1.elapsed().as_secs_f64()))
}

/// The middle value of `v` (the upper one of an even count; NaN when empty): how a profile,
/// a benchmark and a run's summary report repeated timings.
pub fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Profiles every layer of `model`, built by `build`, on the micro-batch `sample`: the median
/// of `repeats` timings of each layer's forward and backward, and of its split backward's
/// input and weight parts (the median, not the fastest: a training step's time is measured as
/// the median of its steps, and on a busy machine the fastest of a few is a lucky one).
/// With a `loss`, the last layer's forward and backward (and its split backward's input part)
/// include the loss after it, timed as often: the last pipeline stage computes it.
pub fn profile_layers(
    model: &Sequential,
    build: &Build,
    sample: &Batch,
    repeats: usize,
    loss: Option<&dyn Loss>,
) -> Result<Vec<LayerCost>> {
    profile_stage(&model.build(build)?, sample, repeats, loss)
}

/// What a [`sweep`] gave: each layer's pass with the bytes of its float input, and the
/// loss's forward and backward seconds.
type Sweep = (Vec<(Pass, usize)>, Option<(f64, f64)>);

/// One micro-batch through `stage` as a pipeline stage runs it: every layer's forward in
/// order from `input`, the `loss` after the last (if any), then every layer's backward in
/// reverse (with `split`, each followed by its weight gradients). Each layer is timed on its
/// own ([`Forwarded`]) but in this order, so it finds the caches as a stage leaves them: timed
/// twice in a row instead, a layer's second pass found its weights and input in the core's
/// cache from the first, and the profile predicted this machine's layouts fast (8 of 13 by
/// more than 10 %, up to 27 %).
/// `pause` runs after the forwards (and the loss) and after the backwards, where a stage's
/// rank waits for its next message (the crowding trial's copies wait for each other there).
pub(super) fn sweep(
    stage: &Stage,
    input: &Activation,
    cx: &mut Cx,
    split: bool,
    loss: Option<(&dyn Loss, &Batch)>,
    pause: &dyn Fn() -> Result<()>,
) -> Result<Sweep> {
    let sync = || stage.tp().comm().map_or(Ok(()), |c| c.barrier());
    let mut x = input.clone();
    let mut forwards = Vec::with_capacity(stage.layers().len());
    for layer in stage.layers() {
        let floats = x.tensors().into_iter().filter(|t| t.dtype().is_float());
        let input_bytes: usize = floats.map(bytes).sum();
        let f = Forwarded::run(layer.as_ref(), &x, cx, split, &sync)?;
        let y = f.output();
        let next = y
            .tensors()
            .into_iter()
            .map(|t| {
                let d = t.detach();
                cx.set_parallel_dim(&d, cx.parallel_dim(t));
                d
            })
            .collect();
        x = Activation::from_tensors(next, y.is_tuple());
        forwards.push((f, input_bytes));
    }
    let loss_s = loss
        .map(|(loss, batch)| {
            sync()?;
            loss_pass(loss, &x, batch, cx, stage.tp())
        })
        .transpose()?;
    drop(x);
    pause()?;
    let mut passes = Vec::with_capacity(forwards.len());
    while let Some((f, input_bytes)) = forwards.pop() {
        passes.push((f.backward(&sync)?, input_bytes));
    }
    passes.reverse();
    pause()?;
    Ok((passes, loss_s))
}

/// [`profile_layers`] of a model already built (`stage`, its tensor-parallel group its
/// loss's): a profile that times the same layers many times builds them once.
pub fn profile_stage(
    stage: &Stage,
    sample: &Batch,
    repeats: usize,
    loss: Option<&dyn Loss>,
) -> Result<Vec<LayerCost>> {
    let input = Activation::from_batch(sample, stage.input_names(), "the model")?;
    let mut cx = Cx::new(Mode::Train, 0, 0, 0);
    let layers = stage.layers();
    // Per layer: forward, backward, input and weight gradients and the CPU of the first two,
    // each timing of the repeats.
    let mut timed: Vec<[Vec<f64>; 5]> = vec![Default::default(); layers.len()];
    let mut loss_timed: [Vec<f64>; 3] = Default::default();
    let mut last = None;
    let loss = loss.map(|l| (l, sample));
    for _ in 0..repeats.max(1) {
        let (splits, split_loss) = sweep(stage, &input, &mut cx, true, loss, &|| Ok(()))?;
        let (wholes, whole_loss) = sweep(stage, &input, &mut cx, false, loss, &|| Ok(()))?;
        for (slot, ((split, _), (whole, _))) in timed.iter_mut().zip(splits.iter().zip(&wholes)) {
            let times = [
                whole.forward_s,
                whole.backward_s,
                split.backward_s,
                split.weight_s,
                whole.cpu_s.unwrap_or(f64::NAN),
            ];
            for (s, t) in slot.iter_mut().zip(times) {
                s.push(t);
            }
        }
        if let (Some((_, b)), Some((f, w))) = (split_loss, whole_loss) {
            for (s, t) in loss_timed.iter_mut().zip([f, w, b]) {
                s.push(t);
            }
        }
        last = Some((splits, wholes));
    }
    let (splits, wholes) = last.expect("at least one repeat");
    let mut out: Vec<LayerCost> = layers
        .iter()
        .zip(splits.into_iter().zip(wholes))
        .zip(timed)
        .map(|((layer, ((split, _), (whole, input_bytes))), timed)| {
            let param_bytes: usize = layer
                .params()
                .iter()
                .map(|(_, v)| bytes(v.as_tensor()))
                .sum();
            let median = timed.map(median);
            // Beyond the parameters' gradients (the rank's state) and the split backward's
            // queue; what the store still held at the end less the input's gradient (in a
            // stage, the next layer's backward takes it).
            LayerCost {
                name: layer.name().to_string(),
                forward_s: median[0],
                backward_s: median[1],
                backward_input_s: median[2],
                backward_weight_s: median[3],
                cpu_s: Some(median[4]).filter(|c| c.is_finite()),
                param_bytes,
                activation_bytes: whole.output_bytes,
                kept_bytes: whole.kept,
                split_kept_bytes: split.kept,
                deferred_bytes: split.queued,
                backward_transient_bytes: whole.peak.map(|p| {
                    let ended = p.ended.saturating_sub(param_bytes + input_bytes);
                    (p.most.saturating_sub(param_bytes), ended)
                }),
                input_transient_bytes: split.peak.map(|p| {
                    let ended = p.ended.saturating_sub(p.after + input_bytes);
                    (p.most.saturating_sub(p.after), ended)
                }),
            }
        })
        .collect();
    if let Some(last) = out.last_mut().filter(|_| loss.is_some()) {
        let [f, b, bi] = loss_timed.map(median);
        last.forward_s += f;
        last.backward_s += b;
        last.backward_input_s += bi;
    }
    Ok(out)
}
