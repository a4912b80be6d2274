//! [`ZeroShards`]: what a ZeRO rank keeps of its stage's f32 state (the master pieces the
//! optimizer updates) and how it moves between that and whole tensors: the model's weights
//! after each step, and the layout-free checkpoint.

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};

use super::gather::LayerGather;
use super::plan::ShardPlan;
use super::Zero;
use crate::distributed::comm::Communicator;
use crate::model::grads::Grads;
use crate::model::nn::optim::StateDict;
use crate::{invalid, Result};

/// One rank's ZeRO state: the plan, the model's weights (whole, in the compute type) and the
/// f32 master pieces of this member's shards, which the optimizer is made over.
pub struct ZeroShards {
    stage: Zero,
    plan: ShardPlan,
    model: Vec<(String, Var)>,
    pieces: Vec<(String, Var)>,
    gather: Option<Arc<LayerGather>>,
}

impl ZeroShards {
    /// Cuts this member's master pieces from `masters` (f32, whole, the model's names);
    /// `model` are the weights the model computes with.
    pub fn new(
        stage: Zero,
        plan: ShardPlan,
        model: Vec<(String, Var)>,
        masters: &[(String, Var)],
    ) -> Result<Self> {
        let whole: BTreeMap<&str, &Var> = masters.iter().map(|(n, v)| (n.as_str(), v)).collect();
        let pieces = plan
            .cut(|n| whole.get(n).map(|v| v.as_tensor().clone()))?
            .into_iter()
            // A copy: a view would keep the whole master alive and alias the model's weight.
            .map(|(n, t)| Ok((n, Var::from_tensor(&t.copy()?)?)))
            .collect::<Result<Vec<_>>>()?;
        if pieces.len() != plan.pieces().len() {
            return Err(invalid!(
                "ZeRO: {} master weights for {} pieces",
                pieces.len(),
                plan.pieces().len()
            ));
        }
        Ok(Self {
            stage,
            plan,
            model,
            pieces,
            gather: None,
        })
    }

    /// ZeRO-3: the layers gather their weights through `gather`.
    pub fn with_gather(mut self, gather: Arc<LayerGather>) -> Self {
        self.gather = Some(gather);
        self
    }

    /// The layers' gatherer under ZeRO-3.
    pub fn gather(&self) -> Option<&Arc<LayerGather>> {
        self.gather.as_ref()
    }

    /// The ZeRO stage.
    pub fn stage(&self) -> Zero {
        self.stage
    }

    /// The plan.
    pub fn plan(&self) -> &ShardPlan {
        &self.plan
    }

    /// The f32 master pieces, by their parameters' names: what the optimizer updates.
    pub fn pieces(&self) -> &[(String, Var)] {
        &self.pieces
    }

    /// The master pieces' values by name, as [`ShardPlan::gather`] takes them.
    fn piece_values(&self) -> BTreeMap<String, Tensor> {
        self.pieces
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect()
    }

    /// This member's pieces of whole gradients (ZeRO-1: every member holds the summed
    /// gradients and keeps its pieces' part of them).
    pub fn cut_grads(&self, whole: &Grads) -> Result<Grads> {
        let mut out = Grads::new();
        for (n, t) in self.plan.cut(|n| whole.get(n).cloned())? {
            out.insert(n, t);
        }
        Ok(out)
    }

    /// Gives every member's updated pieces to the model's weights (collective over the
    /// group: the all-gather after each optimizer step). Under ZeRO-3 there is nothing to
    /// give: each layer gathers its weights from the pieces when it computes, and what was
    /// gathered ahead of the step is dropped ([`LayerGather::forget`]).
    pub fn publish(&self, comm: &dyn Communicator) -> Result<()> {
        if let Some(g) = &self.gather {
            return g.forget();
        }
        if self.stage == Zero::Parameters {
            return Ok(());
        }
        let mine = self.piece_values();
        let model: BTreeMap<&str, &Var> = self.model.iter().map(|(n, v)| (n.as_str(), v)).collect();
        self.plan.gather_each(comm, &mine, true, |n, t| {
            let var = model
                .get(n)
                .ok_or_else(|| invalid!("ZeRO: gathered `{n}`, which the model does not hold"))?;
            Ok(var.set(&t.to_dtype(var.dtype())?)?)
        })
    }

    /// The whole f32 master weights (collective over the group): the model's own when it
    /// computes in f32 (after [`ZeroShards::publish`] they equal the masters), else gathered
    /// from the pieces. For a checkpoint.
    pub fn whole_masters(&self, comm: &dyn Communicator) -> Result<Vec<(String, Var)>> {
        let released = self.stage == Zero::Parameters;
        if !released && self.model.iter().all(|(_, v)| v.dtype() == DType::F32) {
            return Ok(self.model.clone());
        }
        let mine = self.piece_values();
        let whole = self.plan.gather(comm, &mine, true)?;
        self.model
            .iter()
            .map(|(n, _)| {
                let t = whole
                    .get(n)
                    .ok_or_else(|| invalid!("ZeRO: no gathered value for `{n}`"))?;
                Ok((n.clone(), Var::from_tensor(t)?))
            })
            .collect()
    }

    /// The optimizer's state over whole parameters (collective over the group) from its
    /// `state` over this member's pieces: every `<param>.<entry>` gathered, `step` as it is.
    pub fn whole_state(&self, comm: &dyn Communicator, state: &StateDict) -> Result<StateDict> {
        let mut kinds: Vec<String> = Vec::new();
        for key in state.keys() {
            if let Some((_, e)) = key.rsplit_once('.') {
                if !kinds.iter().any(|k| k == e) {
                    kinds.push(e.to_string());
                }
            }
        }
        let kinds = agree_kinds(comm, kinds)?;
        let mut out = StateDict::new();
        if let Some(s) = state.get("step") {
            out.insert("step".into(), s.clone());
        }
        for kind in kinds {
            let mine = self
                .pieces
                .iter()
                .filter_map(|(n, _)| {
                    state
                        .get(&format!("{n}.{kind}"))
                        .map(|t| (n.clone(), t.clone()))
                })
                .collect();
            for (n, t) in self.plan.gather(comm, &mine, false)? {
                out.insert(format!("{n}.{kind}"), t);
            }
        }
        Ok(out)
    }

    /// This member's pieces of an optimizer state over whole parameters (as a checkpoint
    /// holds it), for the optimizer over the pieces.
    pub fn cut_state(&self, whole: &StateDict) -> Result<StateDict> {
        let mut out = StateDict::new();
        for (key, t) in whole {
            let Some((name, _)) = key.rsplit_once('.').filter(|_| key != "step") else {
                out.insert(key.clone(), t.clone());
                continue;
            };
            let Some(p) = self.plan.piece(name) else {
                continue;
            };
            out.insert(key.clone(), p.cut(t, key)?);
        }
        Ok(out)
    }

    /// Sets the master pieces and the model's weights (under ZeRO-3 the pieces alone: the
    /// layers gather from them) from whole f32 masters (a checkpoint or pretrained weights
    /// every member read whole).
    pub fn load_masters(&self, whole: &[(String, Var)]) -> Result<()> {
        let by_name: BTreeMap<&str, &Var> = whole.iter().map(|(n, v)| (n.as_str(), v)).collect();
        let cut = self
            .plan
            .cut(|n| by_name.get(n).map(|v| v.as_tensor().clone()))?;
        for ((n, piece), (name, var)) in cut.iter().zip(&self.pieces) {
            debug_assert_eq!(n, name);
            var.set(piece)?;
        }
        if let Some(g) = &self.gather {
            return g.forget();
        }
        if self.stage == Zero::Parameters {
            return Ok(());
        }
        for (n, var) in &self.model {
            if let Some(w) = by_name.get(n.as_str()) {
                if w.as_tensor().id() != var.as_tensor().id() {
                    var.set(&w.as_tensor().to_dtype(var.dtype())?)?;
                }
            }
        }
        Ok(())
    }
}

/// The entry kinds any member's optimizer state holds (collective): a member whose pieces
/// have no state yet still gathers what the others hold.
fn agree_kinds(comm: &dyn Communicator, kinds: Vec<String>) -> Result<Vec<String>> {
    if comm.size() == 1 {
        return Ok(kinds);
    }
    // Never empty (a member without state sends the terminator alone).
    let mut joined: Vec<u32> = kinds.join(",").bytes().map(u32::from).collect();
    joined.push(0);
    let t = Tensor::new(joined.as_slice(), &Device::Cpu)?;
    let mut all: Vec<String> = Vec::new();
    for t in comm.all_gather(&t)? {
        let bytes: Vec<u8> = t
            .to_vec1::<u32>()?
            .into_iter()
            .filter(|b| *b != 0)
            .map(|b| b as u8)
            .collect();
        let s = String::from_utf8(bytes).map_err(|e| invalid!("ZeRO: state kinds: {e}"))?;
        for k in s.split(',').filter(|k| !k.is_empty()) {
            if !all.iter().any(|a| a == k) {
                all.push(k.to_string());
            }
        }
    }
    all.sort();
    Ok(all)
}
