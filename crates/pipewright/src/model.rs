//! Model description: the [`Layer`] trait, layer specs (builders) and a [`Sequential`] of them
//! with optional cut points.
//!
//! A model is described, not built: a [`Sequential`] is a list of [`LayerSpec`]s, each a named
//! builder. [`Sequential::build_range`] materialises any contiguous range of layers alone (what
//! a pipeline stage owns); parameters carry global names (`h.3.attn.c_attn.weight`) that do not
//! depend on the range, and their initial values come from [`crate::nn::Init`], keyed by those
//! names, so every split of a model starts from the same weights.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use candle_core::{Tensor, TensorId, Var};

use crate::nn::Init;
use crate::shard::{Shard, TpGroup};
use crate::{invalid, Error, Result};

/// What flows between layers: one tensor or a tuple of tensors, batch on dim 0.
#[derive(Clone, Debug)]
pub enum Activation {
    Tensor(Tensor),
    Tuple(Vec<Tensor>),
}

impl From<Tensor> for Activation {
    fn from(t: Tensor) -> Self {
        Activation::Tensor(t)
    }
}

impl Activation {
    /// The single tensor, or an error naming `layer` if this is a tuple.
    pub fn into_tensor(self, layer: &str) -> Result<Tensor> {
        match self {
            Activation::Tensor(t) => Ok(t),
            Activation::Tuple(ts) => Err(Error::Layer {
                layer: layer.to_string(),
                msg: format!("expects one tensor, got a tuple of {}", ts.len()),
            }),
        }
    }

    /// Every tensor of the activation, in order.
    pub fn tensors(&self) -> Vec<&Tensor> {
        match self {
            Activation::Tensor(t) => vec![t],
            Activation::Tuple(ts) => ts.iter().collect(),
        }
    }

    /// The batch size (dim 0 of the first tensor).
    pub fn batch_size(&self) -> Result<usize> {
        let t = self
            .tensors()
            .first()
            .copied()
            .ok_or_else(|| invalid!("an empty tuple has no batch dimension"))?
            .clone();
        Ok(t.dims().first().copied().unwrap_or(0))
    }
}

/// Train or evaluation mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Train,
    Eval,
}

/// Per-forward context handed to every layer: the mode, the step and micro-batch (so seeded
/// randomness such as dropout is reproducible, also when recomputed), whether this forward is a
/// recomputation, and the skip-connection stash.
#[derive(Debug)]
pub struct Cx {
    pub mode: Mode,
    pub seed: u64,
    pub step: u64,
    pub micro_batch: usize,
    /// Deferred batch norm (torchgpipe): BatchNorm layers add this micro-batch's moments to the
    /// batch's and move their running statistics once, at [`Layer::finish_batch`].
    pub defer_batch_stats: bool,
    /// Zero-bubble split backward: weight-bearing layers queue their weight gradients here
    /// instead of computing them in the backward pass.
    pub weight_grads: Option<crate::nn::deferred::WeightGradQueue>,
    recomputing: bool,
    stash: HashMap<String, Tensor>,
    /// Activations split over the tensor-parallel group, by tensor (see [`crate::shard::attr`]).
    parallel: HashMap<TensorId, i64>,
}

impl Cx {
    pub fn new(mode: Mode, seed: u64, step: u64, micro_batch: usize) -> Self {
        Self {
            mode,
            seed,
            step,
            micro_batch,
            defer_batch_stats: false,
            weight_grads: None,
            recomputing: false,
            stash: HashMap::new(),
            parallel: HashMap::new(),
        }
    }

    /// A context for inference: evaluation mode, no randomness.
    pub fn eval() -> Self {
        Self::new(Mode::Eval, 0, 0, 0)
    }

    pub fn is_training(&self) -> bool {
        self.mode == Mode::Train
    }

    /// True while a forward pass is being recomputed for the backward pass (torchgpipe's
    /// `is_recomputing`): layers with side effects (running statistics) must skip them.
    pub fn is_recomputing(&self) -> bool {
        self.recomputing
    }

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

    /// Marks `t` as split on `dim` over the tensor-parallel group (`None` clears the mark);
    /// see [`crate::shard::register_parallel_dim`].
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

/// One built layer. Parameters are [`Var`]s with global names.
pub trait Layer: Send + Sync {
    /// The layer's global name (`h.3`).
    fn name(&self) -> &str;
    fn forward(&self, x: Activation, cx: &mut Cx) -> Result<Activation>;
    /// Trainable parameters with global names.
    fn params(&self) -> Vec<(String, Var)>;
    /// Non-trained state saved with the model (BatchNorm running statistics).
    fn buffers(&self) -> Vec<(String, Var)> {
        Vec::new()
    }
    /// Called once after every training batch (commits deferred batch-norm statistics).
    fn finish_batch(&self) -> Result<()> {
        Ok(())
    }
    /// How each tensor-parallel parameter is split (parameters not listed are whole, and equal
    /// on every rank of the group).
    fn shards(&self) -> Vec<(String, Shard)> {
        Vec::new()
    }
}

type BuildFn = dyn Fn(&Init) -> Result<Box<dyn Layer>> + Send + Sync;

/// A named builder of one layer, with the skip connections it stashes and pops (torchgpipe's
/// `@skippable(stash=[...], pop=[...])`), so that a pipeline can route them between stages.
#[derive(Clone)]
pub struct LayerSpec {
    name: String,
    build: Arc<BuildFn>,
    stashes: Vec<String>,
    pops: Vec<String>,
}

impl std::fmt::Debug for LayerSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LayerSpec({})", self.name)
    }
}

impl LayerSpec {
    pub fn new(
        name: impl Into<String>,
        build: impl Fn(&Init) -> Result<Box<dyn Layer>> + Send + Sync + 'static,
    ) -> Self {
        Self {
            name: name.into(),
            build: Arc::new(build),
            stashes: Vec::new(),
            pops: Vec::new(),
        }
    }

    /// Declares the skip connections this layer stashes ([`Cx::stash`]).
    pub fn stashes(mut self, names: &[&str]) -> Self {
        self.stashes.extend(names.iter().map(|n| n.to_string()));
        self
    }

    /// Declares the skip connections this layer pops ([`Cx::pop`]).
    pub fn pops(mut self, names: &[&str]) -> Self {
        self.pops.extend(names.iter().map(|n| n.to_string()));
        self
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn build(&self, init: &Init) -> Result<Box<dyn Layer>> {
        (self.build)(init)
    }
}

/// An ordered list of layer specs with optional cut points.
///
/// A cut point `k` marks the boundary before layer `k` as a place where the model may be split.
/// Without cut points every boundary may be a stage boundary.
#[derive(Clone, Debug, Default)]
pub struct Sequential {
    specs: Vec<LayerSpec>,
    cut_points: Vec<usize>,
}

impl Sequential {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a layer.
    pub fn push(&mut self, spec: LayerSpec) -> &mut Self {
        self.specs.push(spec);
        self
    }

    /// Marks a cut point after the layers pushed so far (Varuna's `CutPoint`).
    pub fn cut(&mut self) -> &mut Self {
        let k = self.specs.len();
        if k > 0 && self.cut_points.last() != Some(&k) {
            self.cut_points.push(k);
        }
        self
    }

    pub fn len(&self) -> usize {
        self.specs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }

    pub fn specs(&self) -> &[LayerSpec] {
        &self.specs
    }

    /// Boundaries (layer indices) where the model may be split.
    pub fn cut_points(&self) -> &[usize] {
        &self.cut_points
    }

    /// The declared skip connections: (name, stashing layer, popping layer). Each name is
    /// stashed by exactly one layer and popped by exactly one later layer.
    pub fn skips(&self) -> Result<Vec<Skip>> {
        let mut out: Vec<Skip> = Vec::new();
        for (i, spec) in self.specs.iter().enumerate() {
            for name in &spec.stashes {
                if out.iter().any(|s| &s.name == name) {
                    return Err(invalid!(
                        "skip `{name}` is stashed by two layers (the second is `{}`)",
                        spec.name
                    ));
                }
                out.push(Skip {
                    name: name.clone(),
                    from: i,
                    to: usize::MAX,
                });
            }
            for name in &spec.pops {
                let skip = out.iter_mut().find(|s| &s.name == name).ok_or_else(|| {
                    invalid!(
                        "layer `{}` pops skip `{name}`, which no earlier layer stashes",
                        spec.name
                    )
                })?;
                if skip.to != usize::MAX {
                    return Err(invalid!(
                        "skip `{name}` is popped twice (the second time by `{}`)",
                        spec.name
                    ));
                }
                skip.to = i;
            }
        }
        if let Some(s) = out.iter().find(|s| s.to == usize::MAX) {
            return Err(invalid!(
                "skip `{}` is stashed by `{}` but no later layer pops it",
                s.name,
                self.specs[s.from].name
            ));
        }
        Ok(out)
    }

    /// Builds every layer.
    pub fn build(&self, init: &Init) -> Result<Stage> {
        self.build_range(0..self.len(), init)
    }

    /// Builds layers `range` alone: what a pipeline stage owns.
    pub fn build_range(&self, range: Range<usize>, init: &Init) -> Result<Stage> {
        if range.start >= range.end || range.end > self.len() {
            return Err(invalid!(
                "layer range {range:?} is empty or outside the model's {} layers",
                self.len()
            ));
        }
        let layers = self.specs[range.clone()]
            .iter()
            .map(|s| s.build(init))
            .collect::<Result<Vec<_>>>()?;
        Ok(Stage {
            range,
            layers,
            tp: init.tp.clone(),
        })
    }
}

/// A declared skip connection between two layers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skip {
    pub name: String,
    /// Index of the stashing layer.
    pub from: usize,
    /// Index of the popping layer.
    pub to: usize,
}

/// A built contiguous range of layers.
pub struct Stage {
    range: Range<usize>,
    layers: Vec<Box<dyn Layer>>,
    tp: TpGroup,
}

impl Stage {
    /// Which layers of the model this stage holds.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    pub fn layers(&self) -> &[Box<dyn Layer>] {
        &self.layers
    }

    /// Runs every layer in order.
    pub fn forward(&self, x: Activation, cx: &mut Cx) -> Result<Activation> {
        self.layers.iter().try_fold(x, |x, l| l.forward(x, cx))
    }

    /// Every trainable parameter with its global name, in layer order.
    pub fn params(&self) -> Vec<(String, Var)> {
        self.layers.iter().flat_map(|l| l.params()).collect()
    }

    /// Every buffer with its global name.
    pub fn buffers(&self) -> Vec<(String, Var)> {
        self.layers.iter().flat_map(|l| l.buffers()).collect()
    }

    /// The tensor-parallel group the stage was built for.
    pub fn tp(&self) -> &TpGroup {
        &self.tp
    }

    /// Every sharded parameter with how it is split.
    pub fn shards(&self) -> Vec<(String, Shard)> {
        self.layers.iter().flat_map(|l| l.shards()).collect()
    }

    /// Ends a training batch in every layer.
    pub fn finish_batch(&self) -> Result<()> {
        self.layers.iter().try_for_each(|l| l.finish_batch())
    }

    /// The parameter called `name`.
    pub fn param(&self, name: &str) -> Option<Var> {
        self.params()
            .into_iter()
            .find_map(|(n, v)| (n == name).then_some(v))
    }

    /// Number of scalar parameters.
    pub fn num_params(&self) -> usize {
        self.params().iter().map(|(_, v)| v.elem_count()).sum()
    }
}
