//! [`Cx`]: the per-forward context every layer gets, and the [`Mode`].

use std::collections::HashMap;

use candle_core::{Tensor, TensorId};

use super::kv_cache::KvCache;
use crate::{Error, Result};

/// Train or evaluation mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Training: dropout on, BatchNorm uses and moves batch statistics.
    Train,
    /// Evaluation: dropout off, BatchNorm uses its running statistics.
    Eval,
}

/// Per-forward context handed to every layer: the mode, the step and micro-batch (so seeded
/// randomness such as dropout is reproducible, also when recomputed), whether this forward is a
/// recomputation, and the skip-connection stash.
#[derive(Debug)]
pub struct Cx {
    /// Train or evaluation.
    pub mode: Mode,
    /// The run's seed.
    pub seed: u64,
    /// The optimizer step this forward belongs to.
    pub step: u64,
    /// The micro-batch's index in the global batch.
    pub micro_batch: usize,
    /// Deferred batch norm (torchgpipe): BatchNorm layers add this micro-batch's moments to the
    /// batch's and move their running statistics once, at [`crate::Layer::finish_batch`].
    pub defer_batch_stats: bool,
    /// Zero-bubble split backward: weight-bearing layers queue their weight gradients here
    /// instead of computing them in the backward pass.
    pub weight_grads: Option<super::deferred::WeightGradQueue>,
    /// Check every layer's output for NaN and inf ([`crate::model::Stage::forward`] fails at
    /// the first, naming the layer, micro-batch and step).
    pub detect_anomaly: bool,
    /// The weight of this micro-batch's auxiliary losses in the backward
    /// ([`crate::model::nn::with_aux_loss`], before each loss's own coefficient): the loss
    /// scale over the global batch's micro-batches, set by the trainer; 0 (no auxiliary
    /// gradient) in evaluation and wherever no trainer set it.
    pub aux_weight: f64,
    /// Incremental decoding: attention layers attend over these cached keys and values too,
    /// and positions start at its [`KvCache::past`] (see [`crate::model::KvCache`]).
    pub kv_cache: Option<KvCache>,
    /// What each mixture of experts routed in this training forward (one entry a mixture;
    /// the trainer sums them into the step's, see [`super::expert_load`]).
    pub expert_loads: Vec<super::expert_load::ExpertLoad>,
    recomputing: bool,
    stash: HashMap<String, Tensor>,
    /// Activations split over the tensor-parallel group, by tensor (see [`crate::parallel::tensor_parallel::attr`]).
    parallel: HashMap<TensorId, i64>,
    /// The host copies of device inputs, by tensor (see [`Cx::host_copy`]).
    host: HashMap<TensorId, Tensor>,
}

impl Cx {
    /// A context in `mode` for micro-batch `micro_batch` of step `step`, seeded by `seed`.
    pub fn new(mode: Mode, seed: u64, step: u64, micro_batch: usize) -> Self {
        Self {
            mode,
            seed,
            step,
            micro_batch,
            defer_batch_stats: false,
            weight_grads: None,
            detect_anomaly: false,
            aux_weight: 0.0,
            kv_cache: None,
            expert_loads: Vec::new(),
            recomputing: false,
            stash: HashMap::new(),
            parallel: HashMap::new(),
            host: HashMap::new(),
        }
    }

    /// A context for inference: evaluation mode, no randomness.
    pub fn eval() -> Self {
        Self::new(Mode::Eval, 0, 0, 0)
    }

    /// The position of this forward's first token: the tokens already in the key/value cache,
    /// 0 without one.
    pub fn position(&self) -> usize {
        self.kv_cache.as_ref().map_or(0, KvCache::past)
    }

    /// Whether the mode is [`Mode::Train`].
    pub fn is_training(&self) -> bool {
        self.mode == Mode::Train
    }

    /// True while a forward pass is being recomputed for the backward pass (torchgpipe's
    /// `is_recomputing`): layers with side effects (running statistics) must skip them.
    pub fn is_recomputing(&self) -> bool {
        self.recomputing
    }

    /// Marks this forward as a recomputation (see [`Cx::is_recomputing`]).
    pub fn set_recomputing(&mut self, on: bool) {
        self.recomputing = on;
    }

    /// Keeps `t` under `name` for a later layer (torchgpipe's `stash`).
    pub fn stash(&mut self, layer: &str, name: &str, t: Tensor) -> Result<()> {
        if self.stash.contains_key(name) {
            return Err(Error::Layer {
                layer: layer.into(),
                msg: format!("stashes `{name}` twice in one forward; pop it before stashing again"),
            });
        }
        self.stash.insert(name.to_string(), t);
        Ok(())
    }

    /// Takes the tensor stashed under `name` (torchgpipe's `pop`).
    pub fn pop(&mut self, layer: &str, name: &str) -> Result<Tensor> {
        self.stash.remove(name).ok_or_else(|| Error::Layer {
            layer: layer.into(),
            msg: format!("pops `{name}` but no earlier layer stashed it"),
        })
    }

    /// Replaces every stashed tensor by what `f` makes of it (a forward cut into one graph per
    /// layer gives later layers a leaf in place of a tensor with a graph behind it).
    pub fn restash(&mut self, mut f: impl FnMut(Tensor) -> Result<Tensor>) -> Result<()> {
        for t in self.stash.values_mut() {
            *t = f(t.clone())?;
        }
        Ok(())
    }

    /// Records `host` as the host copy of the device tensor `t` (a batch input the trainer
    /// moved to the device; [`crate::model::batch::Batch::require_host_first`]).
    pub fn set_host_copy(&mut self, t: &Tensor, host: Tensor) {
        self.host.insert(t.id(), host);
    }

    /// The host copy of `t`, if the trainer recorded one: a layer that reads its input's values
    /// (an embedding checking its ids) reads them there without waiting for the device.
    pub fn host_copy(&self, t: &Tensor) -> Option<&Tensor> {
        self.host.get(&t.id())
    }

    /// Marks `t` as split on `dim` over the tensor-parallel group (`None` clears the mark);
    /// see [`crate::parallel::tensor_parallel::register_parallel_dim`].
    pub fn set_parallel_dim(&mut self, t: &Tensor, dim: Option<i64>) {
        match dim {
            Some(d) => self.parallel.insert(t.id(), d),
            None => self.parallel.remove(&t.id()),
        };
    }

    /// The dim `t` is split on over the tensor-parallel group, `None` when whole.
    pub fn parallel_dim(&self, t: &Tensor) -> Option<i64> {
        self.parallel.get(&t.id()).copied()
    }

    /// Names still stashed (a forward that ends with any is an error: they were never popped).
    pub fn stashed(&self) -> Vec<String> {
        let mut v: Vec<String> = self.stash.keys().cloned().collect();
        v.sort();
        v
    }
}
