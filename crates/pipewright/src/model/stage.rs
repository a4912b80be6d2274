//! [`Stage`]: a built contiguous range of layers, run in order; and [`LayerParams`], where a
//! layer's parameters are between its uses when they are not kept whole (ZeRO-3).

use std::ops::Range;
use std::sync::Arc;

use candle_core::Var;

use super::{Activation, Cx, Layer, Shard};
use crate::distributed::comm::Group;
use crate::Result;

/// Where the parameters of a stage's layers live between uses (ZeRO-3, [`crate::parallel::zero`]): each
/// layer's are fetched (gathered whole) just before it computes and released (their memory
/// given back) just after, in every forward: training, recomputation, evaluation and decoding.
/// Fetching may be collective (over the data-parallel replicas): every replica runs the same
/// forwards in the same order.
pub trait LayerParams: Send + Sync {
    /// Makes the parameters of layer `layer` (its global index) whole.
    fn fetch(&self, layer: usize) -> Result<()>;
    /// Gives their memory back until the next fetch.
    fn release(&self, layer: usize) -> Result<()>;
}

/// A built contiguous range of layers.
pub struct Stage {
    range: Range<usize>,
    layers: Vec<Box<dyn Layer>>,
    tp: Group,
    inputs: Vec<String>,
    at_rest: Option<Arc<dyn LayerParams>>,
}

/// What runs between two layers of a segmented forward ([`Stage::forward_each`]): it gets the
/// index of the layer just run, its output and the context, and gives the next layer's input.
pub type Between<'a> = dyn FnMut(usize, Activation, &mut Cx) -> Result<Activation> + 'a;

impl Stage {
    pub(super) fn new(
        range: Range<usize>,
        layers: Vec<Box<dyn Layer>>,
        tp: Group,
        inputs: Vec<String>,
    ) -> Self {
        Self {
            range,
            layers,
            tp,
            inputs,
            at_rest: None,
        }
    }

    /// Keeps the layers' parameters in `params` between uses (ZeRO-3): every forward fetches
    /// each layer's before it and releases them after. `None` keeps them whole (the default).
    pub fn set_layer_params(&mut self, params: Option<Arc<dyn LayerParams>>) {
        self.at_rest = params;
    }

    /// Whether the layers' parameters are released between uses ([`Stage::set_layer_params`]).
    pub fn releases_params(&self) -> bool {
        self.at_rest.is_some()
    }

    /// Makes layer `layer`'s (global index) parameters whole, when they are released between
    /// uses (a backward needs them again).
    pub fn fetch(&self, layer: usize) -> Result<()> {
        match &self.at_rest {
            Some(p) => p.fetch(layer),
            None => Ok(()),
        }
    }

    /// Releases layer `layer`'s parameters again after [`Stage::fetch`].
    pub fn release(&self, layer: usize) -> Result<()> {
        match &self.at_rest {
            Some(p) => p.release(layer),
            None => Ok(()),
        }
    }

    /// The parameters of layer `layer` (global index), with their global names.
    pub fn layer_params(&self, layer: usize) -> Vec<(String, Var)> {
        layer
            .checked_sub(self.range.start)
            .and_then(|i| self.layers.get(i))
            .map(|l| l.params())
            .unwrap_or_default()
    }
    /// Which layers of the model this stage holds.
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The built layers in order.
    pub fn layers(&self) -> &[Box<dyn Layer>] {
        &self.layers
    }

    /// Runs every layer in order.
    pub fn forward(&self, x: Activation, cx: &mut Cx) -> Result<Activation> {
        self.forward_each(x, cx, &mut |_, y, _| Ok(y))
    }

    /// Runs every layer in order, `between` given each layer's output but the last's, and
    /// its result given to the next layer: a forward cut into one graph per layer (ZeRO-3's
    /// backward runs them one at a time, each layer's parameters whole only for its own).
    pub fn forward_each(
        &self,
        x: Activation,
        cx: &mut Cx,
        between: &mut Between<'_>,
    ) -> Result<Activation> {
        let mut x = x;
        for (i, l) in self.layers.iter().enumerate() {
            let layer = self.range.start + i;
            self.fetch(layer)?;
            let y = l.forward(x, cx);
            self.release(layer)?;
            let y = y?;
            if cx.detect_anomaly {
                check_finite(l.name(), &y, cx)?;
            }
            x = if i + 1 < self.layers.len() {
                between(layer, y, cx)?
            } else {
                y
            };
        }
        Ok(x)
    }

    /// Every trainable parameter with its global name, in layer order.
    pub fn params(&self) -> Vec<(String, Var)> {
        self.layers.iter().flat_map(|l| l.params()).collect()
    }

    /// Every buffer with its global name.
    pub fn buffers(&self) -> Vec<(String, Var)> {
        self.layers.iter().flat_map(|l| l.buffers()).collect()
    }

    /// The batch tensors the model's first layer takes ([`super::Sequential::inputs`]).
    pub fn input_names(&self) -> &[String] {
        &self.inputs
    }

    /// The tensor-parallel group the stage was built for.
    pub fn tp(&self) -> &Group {
        &self.tp
    }

    /// Every sharded parameter with how it is split.
    pub fn shards(&self) -> Vec<(String, Shard)> {
        self.layers.iter().flat_map(|l| l.shards()).collect()
    }

    /// The names of the experts' parameters this rank holds ([`super::Layer::experts`]).
    pub fn experts(&self) -> Vec<String> {
        self.layers.iter().flat_map(|l| l.experts()).collect()
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

/// Fails when a float tensor of `y` holds a NaN or an inf, naming `layer`, the micro-batch and
/// the step (counted from 1, as everywhere a user reads them; `cx.step` is the steps taken).
fn check_finite(layer: &str, y: &Activation, cx: &Cx) -> Result<()> {
    for t in y.tensors().into_iter().filter(|t| t.dtype().is_float()) {
        if !crate::model::grads::all_finite(t)? {
            return Err(crate::invalid!(
                "anomaly: layer `{layer}` produced NaN or inf values in micro-batch {} of step {}: \
                 lower the learning rate, clip gradients, or check this layer's input",
                cx.micro_batch,
                cx.step + 1
            ));
        }
    }
    Ok(())
}
