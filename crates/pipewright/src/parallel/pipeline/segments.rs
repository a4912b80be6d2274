//! A stage's forward cut into one graph per layer, so that its backward can run one layer at
//! a time (ZeRO-3: a layer's parameters are whole only while its own graph runs, see
//! [`crate::model::LayerParams`]; candle's backward over a whole stage would need every one of
//! them at once).
//!
//! Conventions, stated once:
//! - After every layer but the last, the output's floating-point tensors are copied into new
//!   leaves (variables) and the next layer computes from those: the output stays as the root
//!   of its layer's graph. So the leaves cost one activation per layer boundary.
//! - Every stashed tensor with a graph behind it (a skip connection that a later layer pops,
//!   here or on a later stage) becomes a leaf at the same boundary; a tensor that is already a
//!   variable (a skip received from an earlier stage, a leaf) stays.
//! - The backward of a layer's graph starts from (root x gradient of its leaf), summed over
//!   its output's tensors and its stashed ones, where the leaves' gradients come from the
//!   later layers' backwards.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId, Var};

use super::transfer::Received;
use crate::model::{Activation, Cx};
use crate::Result;

/// Where one layer's graph ends and the next one's begins.
struct Cut {
    /// The index of the layer whose graph ends here.
    layer: usize,
    /// Its output: the root of its graph.
    output: Activation,
    /// The next layer's input: the output's floating-point tensors as leaves (`None` for
    /// integer ones).
    leaves: Vec<Option<Var>>,
    /// The tensors this layer stashed (with their graph) and the leaves stashed instead.
    stashed: Vec<(Tensor, Var)>,
}

/// The cuts of one micro-batch's forward on one model stage, in layer order (one fewer than
/// the stage has layers).
#[derive(Default)]
pub struct Cuts(Vec<Cut>);

impl Cuts {
    /// Cuts the graph after layer `layer`, whose output is `y`: returns the next layer's input
    /// (leaves), and turns what the layer stashed into leaves too.
    pub fn cut(&mut self, layer: usize, y: Activation, cx: &mut Cx) -> Result<Activation> {
        // A copy of each tensor, even of a leaf passed through: every leaf is this cut's own.
        let tuple = y.is_tuple();
        let detached = y.tensors().into_iter().map(Tensor::detach).collect();
        let next = Received::new(Activation::from_tensors(detached, tuple))?;
        let mut stashed = Vec::new();
        cx.restash(|t| {
            if t.is_variable() {
                return Ok(t);
            }
            let leaf = Var::from_tensor(&t.detach())?;
            let out = leaf.as_tensor().clone();
            stashed.push((t, leaf));
            Ok(out)
        })?;
        self.0.push(Cut {
            layer,
            output: y,
            leaves: next.vars,
            stashed,
        });
        Ok(next.activation)
    }

    /// The layer whose graph ends at the last cut, if any.
    pub(super) fn last_layer(&self) -> Option<usize> {
        self.0.last().map(|c| c.layer)
    }

    /// Every leaf of every cut (whose gradients the later layers' backwards give).
    pub(super) fn leaves(&self) -> Vec<Tensor> {
        self.0
            .iter()
            .flat_map(|c| {
                let next = c.leaves.iter().flatten();
                next.chain(c.stashed.iter().map(|(_, l)| l))
            })
            .map(|v| v.as_tensor().clone())
            .collect()
    }

    /// Takes the last cut: its layer and the objective whose backward carries the gradients
    /// `leaves` holds for its leaves into its graph (`None` when none reached them).
    pub(super) fn pop_objective(
        &mut self,
        leaves: &Leaves,
    ) -> Result<Option<(usize, Option<Tensor>)>> {
        let Some(c) = self.0.pop() else {
            return Ok(None);
        };
        let pairs = c
            .output
            .tensors()
            .into_iter()
            .zip(&c.leaves)
            .filter_map(|(t, l)| l.as_ref().map(|l| (t.clone(), l.clone())))
            .chain(c.stashed);
        let mut objective: Option<Tensor> = None;
        for (root, leaf) in pairs {
            if let Some(g) = leaves.grad(leaf.as_tensor()) {
                let term = (root * g.detach())?.sum_all()?;
                objective = Some(match objective {
                    Some(o) => (o + term)?,
                    None => term,
                });
            }
        }
        Ok(Some((c.layer, objective)))
    }
}

/// The gradients that one layer's backward gives the leaves of earlier layers (and the
/// stage's input and imported skips), summed over the layers after it.
pub(super) struct Leaves {
    watched: Vec<Tensor>,
    grads: HashMap<TensorId, Tensor>,
}

impl Leaves {
    /// Watches `watched` (leaves, the stage's input variables, imported skips).
    pub(super) fn new(watched: Vec<Tensor>) -> Self {
        Self {
            watched,
            grads: HashMap::new(),
        }
    }

    /// Adds what one backward gave the watched tensors.
    pub(super) fn add(&mut self, store: &GradStore) -> Result<()> {
        for t in &self.watched {
            if let Some(g) = store.get(t) {
                let sum = match self.grads.remove(&t.id()) {
                    Some(s) => (s + g)?,
                    None => g.clone(),
                };
                self.grads.insert(t.id(), sum);
            }
        }
        Ok(())
    }

    /// The summed gradient of `t`, if any backward reached it.
    pub(super) fn grad(&self, t: &Tensor) -> Option<&Tensor> {
        self.grads.get(&t.id())
    }

    /// Every summed gradient, as a store the senders read.
    pub(super) fn into_store(self) -> GradStore {
        let mut store = GradStore::default();
        for (id, g) in self.grads {
            store.insert_id(id, g);
        }
        store
    }
}
