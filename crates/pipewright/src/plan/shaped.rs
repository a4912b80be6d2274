//! A model described by its shapes, layer by layer, without running it: what each model (the
//! GPT, the Llama, the CNN, a user's) tells the planner about itself so that the planner, the
//! memory check and morphing serve every model alike ([`ModelShapes::profile`]).
//!
//! Conventions: every size is per sample and counts elements, not bytes (the profile
//! multiplies by the element size it computes in); a [`ShapedLayer`] is one unit the pipeline
//! may cut after (a layer, or a segment between cut points), and `count` identical units stand
//! for a stack of blocks without listing each (a model of a billion layers is described in a
//! few entries, and sized without allocating one per layer).

use serde::{Deserialize, Serialize};

use super::hardware::Hardware;
use super::profile::{AttentionShape, ExpertShape, Fit, LayerProfile, Profile};
use super::shapes::{LayerShapes, ShapeCost};
use crate::{invalid, Result};

/// The most units a profile lists (each is costed and balanced one by one).
pub const MAX_UNITS: usize = 100_000;

/// One unit of a model (or `count` identical ones in a row) by its shapes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShapedLayer {
    /// Its name; numbered units are named `{name}.{first}`, `{name}.{first + 1}`, ...
    pub name: String,
    /// Identical units in a row.
    pub count: usize,
    /// The number of the first unit of a numbered stack of blocks (`h.0`, `h.1`, ...); none:
    /// each unit is named `name`.
    pub first: Option<usize>,
    /// Parameters of one unit.
    pub params: f64,
    /// Whether tensor parallelism splits it (its time, parameters and the kept elements beyond
    /// `kept_whole` divide by tp).
    pub tp_split: bool,
    /// Its products and element-wise passes, the passes' `elementwise_*_bytes` counted in
    /// elements per token here (the profile scales them by the element's size).
    pub shapes: LayerShapes,
    /// Its causal self-attention, if any.
    pub attention: Option<AttentionShape>,
    /// Elements of its output: what crosses a cut after it.
    pub output: f64,
    /// Elements its forward keeps for its backward ...
    pub kept: f64,
    /// ... of which tensor parallelism splits none.
    pub kept_whole: f64,
    /// Elements the split backward holds from its input pass to its weight pass.
    pub deferred: f64,
    /// Elements all-reduced over the tp group in the forward (and again in the backward).
    pub tp_all_reduce: f64,
    /// The mixture of experts inside the unit, if any (elements per sample exchanged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertShape>,
}

/// A model by its shapes: its units in order and the sizes tensor parallelism must divide.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelShapes {
    /// What the model is, for messages ("this Llama (1.2 B parameters)").
    pub what: String,
    /// The units in model order.
    pub layers: Vec<ShapedLayer>,
    /// A tensor-parallel size must divide each of these (`[1]`: no tensor parallelism).
    pub tp_divides: Vec<usize>,
}

impl ModelShapes {
    /// Parameters of the whole model (a tied copy counted as its layer counts it).
    pub fn params(&self) -> f64 {
        self.layers.iter().map(|l| l.params * l.count as f64).sum()
    }

    /// Units (layers, or segments between cut points) of the whole model.
    pub fn units(&self) -> usize {
        self.layers
            .iter()
            .fold(0usize, |n, l| n.saturating_add(l.count))
    }

    /// Bytes one sample's forward keeps for the backward over the whole model, in
    /// `dtype_bytes`-byte elements (what the memory check charges a micro-batch's row).
    pub fn kept_bytes_per_sample(&self, dtype_bytes: usize) -> f64 {
        let q = dtype_bytes as f64;
        self.layers
            .iter()
            .map(|l| l.kept * q * l.count as f64)
            .sum()
    }

    /// The profile of every unit computing in `dtype_bytes`-byte elements (2: bf16/f16 on the
    /// half-precision peak; 4: f32) on `hw`: each fit is the shapes' cost at tp 1, cp 1 (what
    /// balancing and the profile's printout read); the planner costs the shapes themselves at
    /// each candidate's sizes.
    pub fn profile(&self, hw: &Hardware, dtype_bytes: usize) -> Result<Profile> {
        if dtype_bytes != 2 && dtype_bytes != 4 {
            return Err(invalid!(
                "dtype_bytes is 2 (bf16, f16) or 4 (f32), not {dtype_bytes}"
            ));
        }
        if self.layers.is_empty() || self.layers.iter().any(|l| l.count == 0) {
            return Err(invalid!("{} has no layers to plan", self.what));
        }
        if self.units() > MAX_UNITS {
            return Err(invalid!(
                "{} has {} layers: the planner costs at most {MAX_UNITS} one by one",
                self.what,
                self.units()
            ));
        }
        let mut layers = Vec::new();
        for l in &self.layers {
            let one = l.profile(hw, dtype_bytes);
            let Some(first) = l.first else {
                layers.extend(std::iter::repeat_n(one, l.count));
                continue;
            };
            for i in first..first + l.count {
                layers.push(LayerProfile {
                    name: format!("{}.{i}", l.name),
                    ..one.clone()
                });
            }
        }
        let n = layers.len();
        Ok(Profile {
            source: format!("shapes on {}", hw.name),
            dtype_bytes,
            layers,
            bounds: (0..=n).collect(),
            tp_divides: self.tp_divides.clone(),
            // The peak is the whole device's.
            threads: hw.cores_per_device,
            optimizer: None,
            accumulate: None,
            crowded_efficiency: None,
            action_overhead: None,
        })
    }
}

impl ShapedLayer {
    /// One unit's profile on `hw` in `dtype_bytes`-byte elements.
    fn profile(&self, hw: &Hardware, dtype_bytes: usize) -> LayerProfile {
        let q = dtype_bytes as f64;
        let curve = hw.gemm(dtype_bytes == 2);
        let bw = hw.memory_bandwidth_bytes_per_s;
        let attention = self.attention;
        let shapes = LayerShapes {
            elementwise_whole_bytes: self.shapes.elementwise_whole_bytes * q,
            elementwise_split_bytes: self.shapes.elementwise_split_bytes * q,
            ..self.shapes.clone()
        };
        let cost = |rows: usize| shapes.cost(attention.as_ref(), &curve, bw, rows, 1, 1, false);
        let fit = |part: fn(&ShapeCost) -> f64| {
            let points: Vec<(f64, f64)> = [1, 2, 4, 8].map(|r| (r as f64, part(&cost(r)))).to_vec();
            Fit::through(&points)
        };
        LayerProfile {
            name: self.name.clone(),
            params: self.params as u64,
            tp_split: self.tp_split,
            forward: fit(|c| c.forward),
            backward: fit(|c| c.backward_input + c.backward_weight),
            backward_input: Some(fit(|c| c.backward_input)),
            backward_weight: Some(fit(|c| c.backward_weight)),
            output_bytes_per_sample: self.output * q,
            kept_bytes_per_sample: self.kept * q,
            kept_whole_bytes_per_sample: self.kept_whole * q,
            transient: None,
            split_kept_bytes_per_sample: None,
            deferred_bytes_per_sample: self.deferred * q,
            tp_all_reduce_bytes_per_sample: self.tp_all_reduce * q,
            experts: self.experts.map(|x| ExpertShape {
                all_to_all: x.all_to_all * q,
                ..x
            }),
            split: Vec::new(),
            measured: Vec::new(),
            attention,
            shapes: Some(shapes.clone()),
        }
    }
}
