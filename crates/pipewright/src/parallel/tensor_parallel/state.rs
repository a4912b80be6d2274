//! State dicts between sharded and whole form (TorchShard's `collect_state_dict` and
//! `relocate_state_dict`): a whole state dict is keyed by global names and holds every
//! parameter at its whole shape, whatever the tensor-parallel size it came from, so a state
//! collected at one size relocates into any other.

use std::collections::{HashMap, HashSet};

use candle_core::Tensor;

use super::{assemble, part};
use crate::model::Stage;
use crate::{Error, Result};

/// The stage's parameters and buffers (this rank's shards), by global name.
pub fn state_dict(model: &Stage) -> Vec<(String, Tensor)> {
    model
        .params()
        .into_iter()
        .chain(model.buffers())
        .map(|(n, v)| (n, v.as_tensor().clone()))
        .collect()
}

/// Whole tensors from this rank's `state` (as [`state_dict`] gives it): every sharded entry
/// is gathered from the group and joined (collective: every rank of the group calls it with
/// the same names in the same order); whole entries pass unchanged.
pub fn collect_state_dict(
    model: &Stage,
    state: &[(String, Tensor)],
) -> Result<Vec<(String, Tensor)>> {
    let shards: HashMap<String, _> = model.shards().into_iter().collect();
    let group = model.tp();
    state
        .iter()
        .map(|(name, t)| match shards.get(name) {
            None => Ok((name.clone(), t.clone())),
            Some(s) => {
                if t.dims() != s.shape() {
                    return Err(Error::State(format!(
                        "`{name}` has shape {:?} but this rank's shard is {:?}",
                        t.dims(),
                        s.shape()
                    )));
                }
                let parts = group.all_gather(&t.contiguous()?)?;
                Ok((name.clone(), assemble(&parts, s.axis, s.stride)?))
            }
        })
        .collect()
}

/// This rank's shards of a whole `state` (as [`collect_state_dict`] or a serial run gives
/// it): sharded entries are cut to this rank's part, whole ones pass unchanged. A sharded
/// entry whose shape is not the whole shape is an error.
pub fn relocate_state_dict(
    model: &Stage,
    state: &[(String, Tensor)],
) -> Result<Vec<(String, Tensor)>> {
    let shards: HashMap<String, _> = model.shards().into_iter().collect();
    state
        .iter()
        .map(|(name, t)| match shards.get(name) {
            None => Ok((name.clone(), t.clone())),
            Some(s) => {
                if t.dims() != s.whole {
                    return Err(Error::State(format!(
                        "`{name}` has shape {:?} but the whole parameter is {:?}: relocate a \
                         collected (whole) state dict, not a shard",
                        t.dims(),
                        s.whole
                    )));
                }
                Ok((
                    name.clone(),
                    part(t, s.axis, s.stride, s.index, s.count)?.contiguous()?,
                ))
            }
        })
        .collect()
}

/// Loads `state` into the stage's parameters and buffers: every one must be present with its
/// exact shape and dtype, and no other entry may be; nothing is changed unless all fit.
pub fn load_state_dict(model: &Stage, state: &[(String, Tensor)]) -> Result<()> {
    let vars: Vec<_> = model.params().into_iter().chain(model.buffers()).collect();
    let given: HashMap<&str, &Tensor> = state.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let known: HashSet<&str> = vars.iter().map(|(n, _)| n.as_str()).collect();
    if let Some((n, _)) = state.iter().find(|(n, _)| !known.contains(n.as_str())) {
        return Err(Error::State(format!(
            "`{n}` is not a parameter or buffer of layers {:?}",
            model.range()
        )));
    }
    for (n, v) in &vars {
        let t = given
            .get(n.as_str())
            .ok_or_else(|| Error::State(format!("`{n}` is missing")))?;
        if t.dims() != v.dims() || t.dtype() != v.dtype() {
            return Err(Error::State(format!(
                "`{n}` is {:?} {:?} but this rank holds {:?} {:?}{}",
                t.dims(),
                t.dtype(),
                v.dims(),
                v.dtype(),
                if model.tp().size() > 1 {
                    format!(
                        " (a shard at tensor-parallel size {}: relocate_state_dict first)",
                        model.tp().size()
                    )
                } else {
                    String::new()
                }
            )));
        }
    }
    for (n, v) in &vars {
        v.set(given[n.as_str()])?;
    }
    Ok(())
}

/// TorchShard's `register_ddp_parameters_to_ignore`: the names of the stage's sharded
/// parameters (data-parallel code must not treat them as whole replicas).
pub fn register_ddp_parameters_to_ignore(model: &Stage) -> Vec<String> {
    model.shards().into_iter().map(|(n, _)| n).collect()
}
