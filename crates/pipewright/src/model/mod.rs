//! Model description: the [`Layer`] trait, layer specs (builders) and a [`Sequential`] of them
//! with optional cut points.
//!
//! A model is described, not built: a [`Sequential`] is a list of [`LayerSpec`]s, each a named
//! builder, and the names of the batch tensors its first layer takes. [`Sequential::build_range`]
//! materialises any contiguous range of layers alone (what a pipeline stage owns); parameters
//! carry global names (`h.3.attn.c_attn.weight`) that do not depend on the range, and their
//! initial values come from [`crate::model::init::Init`], keyed by those names, so every split of a model
//! starts from the same weights. A builder gets a [`Build`]: the initialiser (device, dtype,
//! seed) and the tensor-parallel group its layer splits over.

pub mod batch;
pub mod grads;
pub mod init;
pub mod nn;
pub mod precision;

mod activation;
mod build;
mod cx;
pub mod deferred;
pub mod expert_load;
mod kv_cache;
mod param;
mod stage;

use std::ops::Range;
use std::sync::Arc;

use candle_core::Var;

pub use activation::Activation;
pub use build::Build;
pub use cx::{Cx, Mode};
pub use kv_cache::KvCache;
pub use param::{Shard, WeightLayout};
pub use stage::{Between, LayerParams, Stage};

use crate::model::batch::Batch;
use crate::{invalid, Result};

/// One built layer. Parameters are [`Var`]s with global names.
pub trait Layer: Send + Sync {
    /// The layer's global name (`h.3`).
    fn name(&self) -> &str;
    /// Computes the layer on `x` in the context `cx` (mode, seeds, skip stash).
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
    /// The parameters that are experts this rank holds for its expert-parallel group (see
    /// [`crate::parallel::expert_parallel`]): their gradients are summed over the ranks
    /// holding the same experts, not over every replica. Empty for every layer but a mixture
    /// of experts.
    fn experts(&self) -> Vec<String> {
        Vec::new()
    }
}

type BuildFn = dyn Fn(&Build) -> Result<Box<dyn Layer>> + Send + Sync;

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
    /// A spec named `name` whose `build` makes the layer.
    pub fn new(
        name: impl Into<String>,
        build: impl Fn(&Build) -> Result<Box<dyn Layer>> + Send + Sync + 'static,
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

    /// The layer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Builds the layer.
    pub fn build(&self, b: &Build) -> Result<Box<dyn Layer>> {
        (self.build)(b)
    }
}

/// An ordered list of layer specs with optional cut points, and the batch tensors the first
/// layer takes.
///
/// A cut point `k` marks the boundary before layer `k` as a place where the model may be split.
/// Without cut points every boundary may be a stage boundary. The first layer receives the
/// batch tensor named [`Batch::INPUTS`] unless [`Sequential::inputs`] names others (one name:
/// a tensor; several: a tuple in that order).
#[derive(Clone, Debug)]
pub struct Sequential {
    specs: Vec<LayerSpec>,
    cut_points: Vec<usize>,
    inputs: Vec<String>,
}

impl Default for Sequential {
    fn default() -> Self {
        Self {
            specs: Vec::new(),
            cut_points: Vec::new(),
            inputs: vec![Batch::INPUTS.to_string()],
        }
    }
}

impl Sequential {
    /// An empty model taking [`Batch::INPUTS`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Names the batch tensors the first layer takes (Varuna's inputs of `get_batch_fn`'s
    /// dict): one name gives the layer a tensor, several a tuple in this order.
    pub fn inputs(&mut self, names: &[&str]) -> &mut Self {
        self.inputs = names.iter().map(|n| n.to_string()).collect();
        self
    }

    /// The batch tensors the first layer takes.
    pub fn input_names(&self) -> &[String] {
        &self.inputs
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

    /// The number of layer specs.
    pub fn len(&self) -> usize {
        self.specs.len()
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }

    /// The layer specs in order.
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
    pub fn build(&self, b: &Build) -> Result<Stage> {
        self.build_range(0..self.len(), b)
    }

    /// Builds layers `range` alone: what a pipeline stage owns.
    pub fn build_range(&self, range: Range<usize>, b: &Build) -> Result<Stage> {
        if range.start >= range.end || range.end > self.len() {
            return Err(invalid!(
                "layer range {range:?} is empty or outside the model's {} layers",
                self.len()
            ));
        }
        let layers = self.specs[range.clone()]
            .iter()
            .map(|s| s.build(b))
            .collect::<Result<Vec<_>>>()?;
        Ok(Stage::new(range, layers, b.tp.clone(), self.inputs.clone()))
    }
}

/// A declared skip connection between two layers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skip {
    /// The stage's name (its layer range).
    pub name: String,
    /// Index of the stashing layer.
    pub from: usize,
    /// Index of the popping layer.
    pub to: usize,
}
