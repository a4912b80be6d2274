//! One layer's forward and backward, timed and counted on their own (its input a fresh
//! variable, so the backward stops at it), as two halves: a profile runs every layer's forward
//! in model order and then every backward in reverse, as a stage does
//! ([`super::layer_cost::profile_stage`]).

use std::collections::HashMap;
use std::time::Instant;

use candle_core::{Storage, Tensor, TensorId, Var};

use crate::model::deferred::WeightGradQueue;
use crate::model::{Activation, Cx};
use crate::runtime::cpu_time::thread_cpu_seconds;
use crate::Result;

/// Bytes of `t`'s elements.
pub(super) fn bytes(t: &Tensor) -> usize {
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
pub(super) fn fresh(x: &Activation, cx: &mut Cx) -> Result<Vec<Tensor>> {
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

/// What runs just before a timing starts: a tensor-parallel group's barrier, so that a rank's
/// timing does not include waiting in the layer's first collective for a partner still busy
/// with the untimed work between timings (nothing without tensor parallelism).
pub(super) type Barrier<'a> = dyn Fn() -> Result<()> + 'a;

/// A layer's forward, run and timed, its graph waiting for [`Forwarded::backward`].
pub(super) struct Forwarded {
    forward_s: f64,
    /// The thread's CPU seconds of the forward, where its clock can be read.
    forward_cpu_s: Option<f64>,
    split: bool,
    queue: WeightGradQueue,
    /// The layer's output.
    output: Activation,
    /// The sum of its float outputs: what the backward starts from.
    objective: Option<Tensor>,
    kept: usize,
    /// The thread's live bytes before the forward (with [`crate::runtime::memory::CountingAlloc`]).
    before: Option<u64>,
}

/// What one timed pass of a layer gave.
pub(super) struct Pass {
    pub forward_s: f64,
    /// The backward (with the split backward: its input gradients).
    pub backward_s: f64,
    /// The thread's CPU seconds of the forward and the backward, where its clock can be read:
    /// less than their time by the waits in their collectives.
    pub cpu_s: Option<f64>,
    /// The deferred weight gradients (split backward only).
    pub weight_s: f64,
    /// Bytes of the layer's output.
    pub output_bytes: usize,
    /// Bytes the forward keeps for the backward: the graph's tensors, or with the split
    /// backward and [`crate::runtime::memory::CountingAlloc`] installed, the bytes its forward left live.
    pub kept: usize,
    /// With the split backward: the bytes that wait for the weight gradients once the graph is
    /// gone (the queue's inputs and output gradients, as the allocator counts them where it
    /// can, else the output gradients).
    pub queued: usize,
    /// With [`crate::runtime::memory::CountingAlloc`] installed: what the backward (the input pass)
    /// held beyond what it started with.
    pub peak: Option<Peak>,
}

/// Bytes a backward held beyond what it started with (as [`crate::runtime::memory`] counts them).
#[derive(Clone, Copy)]
pub(super) struct Peak {
    /// The most at once.
    pub most: usize,
    /// When it ended, its gradient store still alive.
    pub ended: usize,
    /// Once the store was gone.
    pub after: usize,
}

/// Live bytes of this thread above `then`, where the allocator counts them.
fn above(then: Option<u64>) -> Option<usize> {
    crate::runtime::memory::thread_live_bytes()
        .zip(then)
        .map(|(n, t)| n.saturating_sub(t) as usize)
}

impl Forwarded {
    /// `layer`'s forward on `x`, timed, with the zero-bubble split backward when `split`;
    /// `sync` runs just before the timing starts (a tensor-parallel group's barrier).
    pub(super) fn run(
        layer: &dyn crate::Layer,
        x: &Activation,
        cx: &mut Cx,
        split: bool,
        sync: &Barrier<'_>,
    ) -> Result<Self> {
        let queue = WeightGradQueue::new();
        cx.weight_grads = split.then(|| queue.clone());
        // A fresh leaf for every float input: the backward stops at this layer.
        let inputs = fresh(x, cx)?;
        let mut leaves: Vec<TensorId> = inputs.iter().map(Tensor::id).collect();
        leaves.extend(layer.params().iter().map(|(_, v)| v.id()));
        let before = crate::runtime::memory::thread_live_bytes();
        sync()?;
        let cpu = thread_cpu_seconds();
        let t0 = Instant::now();
        // (A stash a later layer pops stays in `cx` for it: skip connections.)
        let output = layer.forward(Activation::from_tensors(inputs, x.is_tuple()), cx)?;
        let forward_s = t0.elapsed().as_secs_f64();
        let forward_cpu_s = thread_cpu_seconds().zip(cpu).map(|(b, a)| b - a);
        cx.weight_grads = None;
        let mut objective: Option<Tensor> = None;
        for t in output
            .tensors()
            .into_iter()
            .filter(|t| t.dtype().is_float())
        {
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
        Ok(Forwarded {
            forward_s,
            forward_cpu_s,
            split,
            queue,
            output,
            objective,
            kept,
            before,
        })
    }

    /// The layer's output, before its backward.
    pub(super) fn output(&self) -> &Activation {
        &self.output
    }

    /// The backward of the forward, timed (and with the split backward, its deferred weight
    /// gradients at once after it); `sync` runs just before each timing starts.
    pub(super) fn backward(self, sync: &Barrier<'_>) -> Result<Pass> {
        sync()?;
        let start = crate::runtime::memory::reset_thread_peak();
        let cpu = thread_cpu_seconds();
        let t1 = Instant::now();
        let store = self.objective.as_ref().map(Tensor::backward).transpose()?;
        let backward_s = t1.elapsed().as_secs_f64();
        let cpu_s = thread_cpu_seconds()
            .zip(cpu)
            .zip(self.forward_cpu_s)
            .map(|((b, a), f)| f + b - a);
        let ended = above(start);
        // (Once the gradient store is gone, what stays is the split backward's queue.)
        drop(store);
        let peak = crate::runtime::memory::thread_peak_bytes()
            .zip(start)
            .map(|(p, s)| p.saturating_sub(s) as usize)
            .zip(ended.zip(above(start)))
            .map(|(most, (ended, after))| Peak { most, ended, after });
        let output_bytes = self.output.tensors().into_iter().map(bytes).sum();
        if !self.split {
            return Ok(Pass {
                forward_s: self.forward_s,
                backward_s,
                cpu_s,
                weight_s: 0.0,
                output_bytes,
                kept: self.kept,
                queued: 0,
                peak,
            });
        }
        drop((self.objective, self.output));
        let queued = above(self.before).unwrap_or_else(|| self.queue.pending_bytes());
        sync()?;
        let t2 = Instant::now();
        self.queue.weight_grads(0)?;
        Ok(Pass {
            forward_s: self.forward_s,
            backward_s,
            cpu_s,
            weight_s: t2.elapsed().as_secs_f64(),
            output_bytes,
            kept: self.kept,
            queued,
            peak,
        })
    }
}
