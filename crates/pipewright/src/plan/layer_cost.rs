//! Profiling a model layer by layer on this machine (torchgpipe's `balance_by_time` and
//! `balance_by_size` profile the same way): one micro-batch goes through the layers in turn;
//! each layer's forward and backward are timed alone (its input a fresh variable, so the
//! backward stops at it), and its parameter and output bytes are counted.

use std::time::Instant;

use std::collections::HashMap;

use candle_core::{DType, Storage, Tensor, TensorId, Var};
use serde::Serialize;

use crate::batch::Batch;
use crate::comm::TpGroup;
use crate::loss::{output_in_f32, Loss};
use crate::model::deferred::WeightGradQueue;
use crate::model::{Activation, Build, Cx, Mode, Sequential, Stage};
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
    /// Bytes of its parameters.
    pub param_bytes: usize,
    /// Bytes of its output for the micro-batch.
    pub activation_bytes: usize,
    /// Bytes its forward keeps for the backward (every tensor of its autograd graph but its
    /// parameters and input, each storage counted once).
    pub kept_bytes: usize,
    /// Bytes its forward keeps for the zero-bubble split backward (which runs the plain ops
    /// where the whole backward has fused kernels): as the allocator counts them when
    /// [`crate::memory::CountingAlloc`] is installed, else the graph's as above.
    pub split_kept_bytes: usize,
    /// Bytes the split backward holds from its input pass until its weight pass, once the
    /// graph is gone (the queue's inputs and output gradients): as the allocator counts them
    /// when it is installed, else the queued output gradients.
    pub deferred_bytes: usize,
    /// With [`crate::memory::CountingAlloc`] installed: the most its backward held at once
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

fn bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

/// Bytes of the tensors of `root`'s graph other than `leaves` (parameters and inputs): views
/// share their storage, which counts once at its largest view.
fn graph_bytes(root: &Tensor, leaves: &[TensorId]) -> usize {
    let mut by_storage: HashMap<usize, usize> = HashMap::new();
    for t in root.sorted_nodes() {
        if leaves.contains(&t.id()) {
            continue;
        }
        let (storage, _) = t.storage_and_layout();
        let key = &*storage as *const Storage as usize;
        let b = by_storage.entry(key).or_default();
        *b = (*b).max(bytes(t));
    }
    by_storage.values().sum()
}

/// `x`'s tensors as new leaves: each float one a fresh variable (the backward stops there and
/// gives its gradient) with the tensor-parallel split `cx` marks on the original (a
/// vocabulary-parallel output stays split for the loss), the others as they are.
fn fresh(x: &Activation, cx: &mut Cx) -> Result<Vec<Tensor>> {
    x.tensors()
        .into_iter()
        .map(|t| {
            if !t.dtype().is_float() {
                return Ok(t.clone());
            }
            let v = Var::from_tensor(&t.detach())?.as_tensor().clone();
            cx.set_parallel_dim(&v, cx.parallel_dim(t));
            Ok(v)
        })
        .collect()
}

/// Seconds of the loss after the last layer, forward and backward, as the last pipeline
/// stage runs it on a micro-batch: the output in f32, the summed loss over the rows, read as a
/// number (the pipeline adds it up in f64), and its backward to the output.
fn loss_pass(
    loss: &dyn Loss,
    y: &Activation,
    batch: &Batch,
    cx: &mut Cx,
    tp: &TpGroup,
) -> Result<(f64, f64)> {
    let out = Activation::from_tensors(fresh(y, cx)?, y.is_tuple());
    let t0 = Instant::now();
    let out = output_in_f32(out, cx)?;
    let (sum, _) = loss.sum(&out, batch, cx, tp)?;
    let mean = (sum / batch.rows()? as f64)?;
    mean.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    let forward_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    mean.backward()?;
    Ok((forward_s, t1.elapsed().as_secs_f64()))
}

/// What one timed pass of a layer gave.
struct Pass {
    forward_s: f64,
    /// The backward (with the split backward: its input gradients).
    backward_s: f64,
    /// The deferred weight gradients (split backward only).
    weight_s: f64,
    /// The layer's output (of the whole backward's pass; the split one's is dropped).
    output: Option<Activation>,
    /// Bytes the forward keeps for the backward: the graph's tensors, or with the split
    /// backward and [`crate::memory::CountingAlloc`] installed, the bytes its forward left live.
    kept: usize,
    /// With the split backward: the bytes that wait for the weight gradients once the graph is
    /// gone (the queue's inputs and output gradients, as the allocator counts them where it
    /// can, else the output gradients).
    queued: usize,
    /// With [`crate::memory::CountingAlloc`] installed: what the backward (the input pass)
    /// held beyond what it started with.
    peak: Option<Peak>,
}

/// Bytes a backward held beyond what it started with (as [`crate::memory`] counts them).
#[derive(Clone, Copy)]
struct Peak {
    /// The most at once.
    most: usize,
    /// When it ended, its gradient store still alive.
    ended: usize,
    /// Once the store was gone.
    after: usize,
}

/// One timed pass of `layer` on `x`, with the zero-bubble split backward when `split`.
fn pass(layer: &dyn crate::Layer, x: &Activation, cx: &mut Cx, split: bool) -> Result<Pass> {
    let queue = WeightGradQueue::new();
    cx.weight_grads = split.then(|| queue.clone());
    // A fresh leaf for every float input: the backward stops at this layer.
    let inputs = fresh(x, cx)?;
    let mut leaves: Vec<TensorId> = inputs.iter().map(Tensor::id).collect();
    leaves.extend(layer.params().iter().map(|(_, v)| v.id()));
    let live = crate::memory::thread_live_bytes;
    let above = |then: Option<u64>| live().zip(then).map(|(n, t)| n.saturating_sub(t) as usize);
    let before = live();
    let t0 = Instant::now();
    // (A stash a later layer pops stays in `cx` for it: skip connections.)
    let got = layer.forward(Activation::from_tensors(inputs, x.is_tuple()), cx)?;
    let forward_s = t0.elapsed().as_secs_f64();
    let mut objective: Option<Tensor> = None;
    for t in got.tensors().into_iter().filter(|t| t.dtype().is_float()) {
        let s = t.sum_all()?;
        objective = Some(match objective {
            Some(o) => (o + s)?,
            None => s,
        });
    }
    let graph = || objective.as_ref().map_or(0, |o| graph_bytes(o, &leaves));
    let kept = match split {
        true => above(before).unwrap_or_else(graph),
        false => graph(),
    };
    let start = crate::memory::reset_thread_peak();
    let t1 = Instant::now();
    let store = objective.as_ref().map(Tensor::backward).transpose()?;
    let backward_s = t1.elapsed().as_secs_f64();
    let ended = above(start);
    // (Once the gradient store is gone, what stays is the split backward's queue.)
    drop(store);
    let peak = crate::memory::thread_peak_bytes()
        .zip(start)
        .map(|(p, s)| p.saturating_sub(s) as usize)
        .zip(ended.zip(above(start)))
        .map(|(most, (ended, after))| Peak { most, ended, after });
    if !split {
        return Ok(Pass {
            forward_s,
            backward_s,
            weight_s: 0.0,
            output: Some(got),
            kept,
            queued: 0,
            peak,
        });
    }
    drop((objective, got));
    let queued = above(before).unwrap_or_else(|| queue.pending_bytes());
    let t2 = Instant::now();
    queue.weight_grads(0)?;
    Ok(Pass {
        forward_s,
        backward_s,
        weight_s: t2.elapsed().as_secs_f64(),
        output: None,
        kept,
        queued,
        peak,
    })
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

/// [`profile_layers`] of a model already built (`stage`, its tensor-parallel group its
/// loss's): a profile that times the same layers many times builds them once.
pub fn profile_stage(
    stage: &Stage,
    sample: &Batch,
    repeats: usize,
    loss: Option<&dyn Loss>,
) -> Result<Vec<LayerCost>> {
    let mut x = Activation::from_batch(sample, stage.input_names(), "the model")?;
    let mut cx = Cx::new(Mode::Train, 0, 0, 0);
    let mut out = Vec::new();
    for layer in stage.layers() {
        let mut timed: [Vec<f64>; 4] = Default::default();
        let mut y = None;
        let mut kept = [0; 3];
        let mut transient = (None, None);
        let input_bytes: usize = x
            .tensors()
            .into_iter()
            .filter(|t| t.dtype().is_float())
            .map(bytes)
            .sum();
        let param_bytes: usize = layer
            .params()
            .iter()
            .map(|(_, v)| bytes(v.as_tensor()))
            .sum();
        for _ in 0..repeats.max(1) {
            let split = pass(layer.as_ref(), &x, &mut cx, true)?;
            let whole = pass(layer.as_ref(), &x, &mut cx, false)?;
            let times = [
                whole.forward_s,
                whole.backward_s,
                split.backward_s,
                split.weight_s,
            ];
            for (slot, t) in timed.iter_mut().zip(times) {
                slot.push(t);
            }
            kept = [whole.kept, split.kept, split.queued];
            // Beyond the parameters' gradients (the rank's state) and the split backward's
            // queue; what the store still held at the end less the input's gradient (in a
            // stage, the next layer's backward takes it).
            transient = (
                whole.peak.map(|p| {
                    let ended = p.ended.saturating_sub(param_bytes + input_bytes);
                    (p.most.saturating_sub(param_bytes), ended)
                }),
                split.peak.map(|p| {
                    let ended = p.ended.saturating_sub(p.after + input_bytes);
                    (p.most.saturating_sub(p.after), ended)
                }),
            );
            y = whole.output;
        }
        let y = y.expect("at least one repeat");
        let median = timed.map(median);
        out.push(LayerCost {
            name: layer.name().to_string(),
            forward_s: median[0],
            backward_s: median[1],
            backward_input_s: median[2],
            backward_weight_s: median[3],
            param_bytes,
            activation_bytes: y.tensors().into_iter().map(bytes).sum(),
            kept_bytes: kept[0],
            split_kept_bytes: kept[1],
            deferred_bytes: kept[2],
            backward_transient_bytes: transient.0,
            input_transient_bytes: transient.1,
        });
        let tuple = y.is_tuple();
        let next = y
            .tensors()
            .into_iter()
            .map(|t| {
                let d = t.detach();
                cx.set_parallel_dim(&d, cx.parallel_dim(t));
                d
            })
            .collect();
        x = Activation::from_tensors(next, tuple);
    }
    if let (Some(loss), Some(last)) = (loss, out.last_mut()) {
        let mut timed: [Vec<f64>; 2] = Default::default();
        for _ in 0..repeats.max(1) {
            let (f, b) = loss_pass(loss, &x, sample, &mut cx, stage.tp())?;
            timed[0].push(f);
            timed[1].push(b);
        }
        let [f, b] = timed.map(median);
        last.forward_s += f;
        last.backward_s += b;
        last.backward_input_s += b;
    }
    Ok(out)
}
