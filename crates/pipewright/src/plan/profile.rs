//! A model's costs layer by layer, measured on this machine ([`measure`](fn@super::measure)) or derived
//! from its shapes ([`super::Transformer`]): what the planner balances, simulates and searches.
//! Saved as JSON by `pipewright profile` and read back by `pipewright plan --profile`.

use std::ops::Range;
use std::path::Path;

use serde::{Deserialize, Serialize};

pub use super::shapes::AttentionShape;
use super::shapes::LayerShapes;
use crate::{invalid, Error, Result};

/// Seconds as a straight line in the micro-batch's rows: `fixed_s + per_sample_s * rows`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fit {
    /// Seconds that do not depend on the rows.
    pub fixed_s: f64,
    /// Seconds per row (sample).
    pub per_sample_s: f64,
}

impl Fit {
    /// Seconds for a micro-batch of `rows`.
    pub fn at(&self, rows: usize) -> f64 {
        self.fixed_s + self.per_sample_s * rows as f64
    }

    /// The least-squares line through `(rows, seconds)`. A negative per-sample cost is the
    /// noise of a layer too cheap to time, and becomes none.
    pub fn through(points: &[(f64, f64)]) -> Fit {
        let n = points.len().max(1) as f64;
        let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
        let my = points.iter().map(|p| p.1).sum::<f64>() / n;
        let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
        let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
        let per_sample_s = if sxx > 0.0 { (sxy / sxx).max(0.0) } else { 0.0 };
        Fit {
            fixed_s: (my - per_sample_s * mx).max(0.0),
            per_sample_s,
        }
    }
}

/// Bytes per sample a layer's backward holds at its peak beyond what it started with and what
/// the rest of the step keeps anyway: the gradients of its graph's nodes in candle's store, its
/// output's and its input's. Measured by the allocator ([`crate::runtime::memory::CountingAlloc`]);
/// without it a stage's backward is charged
/// [`BACKWARD_EXTRA_SHARE`](super::rank_memory::BACKWARD_EXTRA_SHARE) of its kept bytes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Transient {
    /// The whole backward, beyond its parameters' gradients (the rank's state counts those)
    /// ...
    pub backward_bytes_per_sample: f64,
    /// ... and of that, what its gradient store still holds when it ends: kept until the
    /// stage's backward ends, while the stage's earlier layers run theirs.
    #[serde(default)]
    pub backward_kept_bytes_per_sample: f64,
    /// The zero-bubble split backward's input pass, beyond what it keeps for the weight
    /// gradients ...
    pub input_bytes_per_sample: f64,
    /// ... and of that, what its gradient store still holds when it ends.
    #[serde(default)]
    pub input_kept_bytes_per_sample: f64,
}

/// Seconds a pipeline's actions take beyond their layers: the executor's messages and
/// bookkeeping, measured by [`super::action_cost`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActionOverhead {
    /// Of a forward ...
    pub forward_s: f64,
    /// ... and of a backward (or a split backward's input pass).
    pub backward_s: f64,
}

/// One timing a measured profile was fitted to.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Timing {
    /// Rows of the micro-batch.
    pub rows: usize,
    /// Seconds of its forward.
    pub forward_s: f64,
    /// Seconds of its full backward.
    pub backward_s: f64,
    /// Seconds of its input gradient.
    pub backward_input_s: f64,
    /// Seconds of its weight gradient.
    pub backward_weight_s: f64,
}

/// What one layer costs on one device, without tensor parallelism.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerProfile {
    /// The layer's name.
    pub name: String,
    /// Parameters (elements).
    pub params: u64,
    /// Whether tensor parallelism splits the layer: its time, parameters and the kept bytes
    /// beyond [`LayerProfile::kept_whole_bytes_per_sample`] divide by the tp size.
    pub tp_split: bool,
    /// Forward seconds.
    pub forward: Fit,
    /// Backward seconds (input and weight gradients).
    pub backward: Fit,
    /// Seconds of the zero-bubble split backward's input gradients (default: half the
    /// backward) ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward_input: Option<Fit>,
    /// ... and of its deferred weight gradients (default: half the backward).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backward_weight: Option<Fit>,
    /// Bytes of the output per sample: what crosses a cut after this layer.
    pub output_bytes_per_sample: f64,
    /// Bytes a micro-batch keeps from this layer's forward until its backward, per sample.
    pub kept_bytes_per_sample: f64,
    /// Bytes per sample the zero-bubble split backward holds from its input pass to its
    /// weight pass, once the graph is gone (the queue's inputs and output gradients).
    #[serde(default)]
    pub deferred_bytes_per_sample: f64,
    /// Bytes per sample its forward keeps for the split backward, as measured (its plain ops
    /// keep more than the whole backward's fused kernels); default: the kept bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split_kept_bytes_per_sample: Option<f64>,
    /// The part of the kept bytes that tensor parallelism does not split.
    pub kept_whole_bytes_per_sample: f64,
    /// What its backward holds at its peak, as measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transient: Option<Transient>,
    /// Bytes per sample all-reduced over the tp group in the forward, and again in the
    /// backward, when the layer is split.
    pub tp_all_reduce_bytes_per_sample: f64,
    /// The mixture of experts inside the layer, if any (its dispatch and combine in bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertShape>,
    /// What one rank's shard costs at tensor-parallel sizes measured as such (its
    /// collectives included); other sizes are modelled from the fields above.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub split: Vec<SplitCost>,
    /// The timings the fits came from (measured profiles).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub measured: Vec<Timing>,
    /// The causal self-attention inside the layer, if any: what context parallelism splits
    /// (its ring's messages and working memory are modelled from it, [`super::context_parallel`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<AttentionShape>,
    /// Its products and element-wise passes by shape (a model planned from its shapes): the
    /// planner costs these on the hardware's curve at each candidate's tp, cp and micro-batch
    /// instead of scaling the fits above.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shapes: Option<LayerShapes>,
}

/// A mixture of experts inside a unit: what expert parallelism splits and moves.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpertShape {
    /// Its routed experts (expert parallelism must divide them).
    pub count: usize,
    /// The parameters its routed experts hold (split over the expert-parallel ranks).
    pub params: f64,
    /// What its dispatch and combine move per sample in the forward (and again in the
    /// backward): elements of a [`super::ShapedLayer`], bytes of a profile's layer.
    pub all_to_all: f64,
}

/// One rank's shard of a layer at a measured tensor-parallel size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SplitCost {
    /// The tensor-parallel size.
    pub tp: usize,
    /// Parameters of the shard.
    pub params: u64,
    /// Forward seconds by rows.
    pub forward: Fit,
    /// Full backward seconds by rows.
    pub backward: Fit,
    /// Input-gradient seconds by rows.
    pub backward_input: Fit,
    /// Weight-gradient seconds by rows.
    pub backward_weight: Fit,
    /// Bytes per sample the shard's forward keeps for its backward (its collectives' outputs
    /// included) and its split backward defers, as measured; a profile without them models
    /// the shard's from the unsplit layer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept_bytes_per_sample: Option<f64>,
    /// Bytes per sample the split backward defers, as measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deferred_bytes_per_sample: Option<f64>,
    /// Bytes per sample its forward keeps for the split backward, as measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split_kept_bytes_per_sample: Option<f64>,
    /// What the shard's backward holds at its peak, as measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transient: Option<Transient>,
    /// The share of its forward and backward time the rank computed, as measured (by its
    /// thread's CPU clock): the rest it waited in the group's collectives, waits that ranks of
    /// other pipeline stages fill when they share the cores.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub busy_share: Option<f64>,
}

/// A model's layers with their costs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// Where the numbers come from (a machine, or `shapes on <hardware>`).
    pub source: String,
    /// Bytes of one element of the computation (4 for f32, 2 for bf16 and f16).
    pub dtype_bytes: usize,
    /// The layers in model order.
    pub layers: Vec<LayerProfile>,
    /// Where the model may be cut: layer indices, the first 0 and the last the layer count
    /// (every layer, or the segments between cut points).
    pub bounds: Vec<usize>,
    /// A tensor-parallel size must divide each of these (attention heads, ...).
    pub tp_divides: Vec<usize>,
    /// CPU threads each layer was timed with (candle's pool; 1 for a GPU). A run's ranks
    /// should have as many for the times to hold (`pipewright plan` warns otherwise).
    #[serde(default = "one")]
    pub threads: usize,
    /// Seconds of the step's update after the schedule (finite check, norm, clip, AdamW) as
    /// a line in the parameters a rank updates (the [`Fit`]'s rows are parameters), timed
    /// here by [`measure`](fn@super::measure); none in a profile from shapes, whose update
    /// is costed from memory bandwidth.
    #[serde(default)]
    pub optimizer: Option<Fit>,
    /// Seconds of adding one micro-batch's gradients into the step's running sum, as a line
    /// in the parameters summed (what every backward after a stage's first micro-batch does),
    /// timed by [`measure`](fn@super::measure); none in a profile from shapes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accumulate: Option<Fit>,
    /// The share of the cores' speed ranks keep while twice as many compute at once as there
    /// are cores, measured with `--concurrent` above 1 ([`super::crowding`]); none: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crowded_efficiency: Option<f64>,
    /// What each action of a pipeline costs beyond its layers (the executor's messages and
    /// bookkeeping), measured with `--concurrent` above 1 ([`super::action_cost`]); none:
    /// nothing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action_overhead: Option<ActionOverhead>,
}

fn one() -> usize {
    1
}

impl Profile {
    /// The routed experts of the model's mixtures (the most of any layer; 0: none): what
    /// expert parallelism must divide.
    pub fn experts(&self) -> usize {
        self.layers
            .iter()
            .filter_map(|l| l.experts.map(|x| x.count))
            .max()
            .unwrap_or(0)
    }

    /// Reads and checks a profile written by [`Profile::save`] (`pipewright profile`).
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("cannot read", path, e))?;
        let p: Profile = serde_json::from_str(&text).map_err(|e| {
            invalid!(
                "profile {} is malformed: {e} (write one with `pipewright profile --out FILE`)",
                path.display()
            )
        })?;
        p.check(&path.display().to_string())?;
        Ok(p)
    }

    /// Writes the profile as JSON.
    pub fn save(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_string_pretty(self).map_err(|e| invalid!("{e}"))?;
        std::fs::write(path, text).map_err(|e| Error::io("cannot write", path, e))
    }

    /// Checks the profile; `what` names it in errors.
    pub fn check(&self, what: &str) -> Result<()> {
        let n = self.layers.len();
        let b = &self.bounds;
        if n == 0 {
            return Err(invalid!("profile {what} has no layers"));
        }
        if b.first() != Some(&0) || b.last() != Some(&n) || b.windows(2).any(|w| w[0] >= w[1]) {
            return Err(invalid!(
                "profile {what}: bounds must rise from 0 to the layer count {n}, got {b:?}"
            ));
        }
        let update = [self.optimizer, self.accumulate]
            .into_iter()
            .flatten()
            .flat_map(|f| [f.fixed_s, f.per_sample_s]);
        let actions = self.action_overhead.map(|a| [a.forward_s, a.backward_s]);
        if update
            .chain(actions.into_iter().flatten())
            .any(|v| !(v.is_finite() && v >= 0.0))
        {
            return Err(invalid!(
                "profile {what}: the optimizer's, the gradient sum's and the actions' seconds \
                 must be finite and not negative"
            ));
        }
        if self.dtype_bytes == 0 || self.threads == 0 || self.tp_divides.contains(&0) {
            return Err(invalid!(
                "profile {what}: dtype_bytes, threads and tp_divides must be positive"
            ));
        }
        for l in &self.layers {
            let split = [l.backward_input, l.backward_weight].into_iter().flatten();
            let values = [
                l.forward.fixed_s,
                l.forward.per_sample_s,
                l.backward.fixed_s,
                l.backward.per_sample_s,
                l.output_bytes_per_sample,
                l.kept_bytes_per_sample,
                l.kept_whole_bytes_per_sample,
                l.deferred_bytes_per_sample,
                l.tp_all_reduce_bytes_per_sample,
            ];
            if let Some(a) = l.attention {
                if a.heads == 0
                    || a.kv_heads == 0
                    || a.head_dim == 0
                    || a.seq == 0
                    || !a.heads.is_multiple_of(a.kv_heads)
                {
                    return Err(invalid!(
                        "profile {what}: layer {}'s attention {a:?} needs positive sizes and \
                         heads a multiple of kv_heads",
                        l.name
                    ));
                }
            }
            let split_values = split.flat_map(|f| [f.fixed_s, f.per_sample_s]);
            let busy = l.split.iter().filter_map(|s| s.busy_share);
            if busy.into_iter().any(|b| !(0.0..=1.0).contains(&b)) {
                return Err(invalid!(
                    "profile {what}: layer {}'s busy share must lie in [0, 1]",
                    l.name
                ));
            }
            let split_kept = std::iter::once(l.split_kept_bytes_per_sample)
                .chain(l.split.iter().map(|s| s.split_kept_bytes_per_sample))
                .flatten();
            let transients = std::iter::once(l.transient)
                .chain(l.split.iter().map(|s| s.transient))
                .flatten()
                .flat_map(|t| {
                    [
                        t.backward_bytes_per_sample,
                        t.backward_kept_bytes_per_sample,
                        t.input_bytes_per_sample,
                        t.input_kept_bytes_per_sample,
                    ]
                });
            if values
                .into_iter()
                .chain(split_values)
                .chain(transients)
                .chain(split_kept)
                .any(|v| !(v.is_finite() && v >= 0.0))
            {
                return Err(invalid!(
                    "profile {what}: layer {} has a negative or non-finite cost",
                    l.name
                ));
            }
        }
        Ok(())
    }

    /// The share of a rank's time in layers `layers`' forwards and in their backwards that
    /// it computes at tensor-parallel size `tp` on micro-batches of `rows`, as measured (each
    /// layer's [`SplitCost::busy_share`] weighted by its time in that pass): `None` where no
    /// layer's was.
    pub fn busy_share(&self, tp: usize, rows: usize, layers: Range<usize>) -> Option<[f64; 2]> {
        let (mut busy, mut time) = ([0.0; 2], [0.0; 2]);
        for s in self.layers[layers].iter().flat_map(|l| l.split.iter()) {
            if let (true, Some(b)) = (s.tp == tp, s.busy_share) {
                for (i, t) in [s.forward.at(rows), s.backward.at(rows)]
                    .into_iter()
                    .enumerate()
                {
                    busy[i] += b * t;
                    time[i] += t;
                }
            }
        }
        (time[0] + time[1] > 0.0).then(|| [0, 1].map(|i| busy[i] / time[i].max(f64::MIN_POSITIVE)))
    }

    /// Tokens per sample of the model's attention (what context parallelism splits), or
    /// `None` when no layer attends.
    pub fn sequence(&self) -> Option<usize> {
        self.layers.iter().find_map(|l| l.attention.map(|a| a.seq))
    }

    /// Forward FLOPs of one sample through the whole model (attention's products whole), when
    /// every layer has its shapes: what MFU counts three times (forward and backward).
    pub fn flops_per_sample(&self) -> Option<f64> {
        self.layers
            .iter()
            .map(|l| {
                l.shapes
                    .as_ref()
                    .map(|s| s.flops_per_sample(l.attention.as_ref()))
            })
            .sum()
    }

    /// Units the model may be split into (layers, or segments between cut points).
    pub fn units(&self) -> usize {
        self.bounds.len() - 1
    }

    /// The layers of units `u`.
    pub fn unit_layers(&self, u: Range<usize>) -> Range<usize> {
        self.bounds[u.start]..self.bounds[u.end]
    }
}
