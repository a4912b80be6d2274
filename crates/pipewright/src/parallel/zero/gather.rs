//! [`LayerGather`]: ZeRO-3's weights between uses. Each member keeps only its f32 master
//! pieces; a layer's weights are all-gathered from them (in f32, then cast to the compute
//! type, so they are exactly what ZeRO-1/2 would have published) into the layer's own
//! variables just before it computes, and emptied just after (`storage.rs`'s `release`).

use std::collections::BTreeMap;

use candle_core::{Tensor, Var};

use super::plan::ShardPlan;
use crate::dist::comm::Communicator;
use crate::model::LayerParams;
use crate::runtime::storage::{refill, release};
use crate::{invalid, Result};

/// A rank's ZeRO-3 weights of its model stages: the plan (buckets never span two layers), the
/// master pieces (shared with the optimizer, which updates them in place) and each layer's
/// variables, fetched over a data-parallel communicator of its own.
pub struct LayerGather {
    plan: ShardPlan,
    comm: Box<dyn Communicator>,
    /// The master pieces' values by name: the optimizer and a checkpoint's load write into
    /// the same storage, so the map made once stays current.
    pieces: BTreeMap<String, Tensor>,
    layers: BTreeMap<usize, Vec<(String, Var)>>,
}

impl LayerGather {
    /// Over `comm` (the data-parallel group, a communicator this alone uses), with `plan`'s
    /// master `pieces` and the model's variables by layer (global index); releases them all.
    pub fn new(
        plan: ShardPlan,
        comm: Box<dyn Communicator>,
        pieces: Vec<(String, Var)>,
        layers: BTreeMap<usize, Vec<(String, Var)>>,
    ) -> Result<Self> {
        let pieces = pieces
            .into_iter()
            .map(|(n, v)| (n, v.as_tensor().clone()))
            .collect();
        let g = Self {
            plan,
            comm,
            pieces,
            layers,
        };
        for layer in g.layers.keys() {
            g.release(*layer)?;
        }
        Ok(g)
    }

    /// Every parameter of the rank whole, in its compute type (collective over the group).
    pub fn gather_all(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for layer in self.layers.keys() {
            for (name, t) in self.gather(*layer)? {
                out.push((name, t));
            }
        }
        Ok(out)
    }

    /// Layer `layer`'s parameters whole, in their compute type (collective over the group).
    fn gather(&self, layer: usize) -> Result<Vec<(String, Tensor)>> {
        let vars = self
            .layers
            .get(&layer)
            .ok_or_else(|| invalid!("ZeRO-3: layer {layer} is not held by this rank"))?;
        let names: Vec<String> = vars.iter().map(|(n, _)| n.clone()).collect();
        let mut out = Vec::new();
        for b in self.plan.buckets_holding(&names) {
            let whole = self
                .plan
                .gather_bucket(b, self.comm.as_ref(), &self.pieces)?;
            for (name, t) in self.plan.params_of_bucket(b, &whole)? {
                if let Some((_, var)) = vars.iter().find(|(n, _)| *n == name) {
                    out.push((name, t.to_dtype(var.dtype())?));
                }
            }
        }
        Ok(out)
    }
}

impl LayerParams for LayerGather {
    fn fetch(&self, layer: usize) -> Result<()> {
        let whole = self.gather(layer)?;
        let vars = &self.layers[&layer];
        for (name, t) in whole {
            if let Some((_, var)) = vars.iter().find(|(n, _)| *n == name) {
                refill(var.as_tensor(), &t)?;
            }
        }
        Ok(())
    }

    fn release(&self, layer: usize) -> Result<()> {
        for (_, var) in self.layers.get(&layer).into_iter().flatten() {
            release(var.as_tensor())?;
        }
        Ok(())
    }
}
