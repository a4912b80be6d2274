//! Optimizers with saveable state, learning-rate schedules and gradient clipping.
//!
//! Semantics follow PyTorch (`torch.optim.SGD`, `torch.optim.AdamW`) step for step, so a
//! PyTorch user gets the same numbers. The state is a flat map of named tensors
//! (`<param>.exp_avg`, `step`, ...) that saves to safetensors.

mod adamw;
mod clip;
mod config;
mod schedule;
mod sgd;

pub use adamw::{is_embedding, AdamW, AdamWConfig};
pub use clip::{clip_grad_norm, scale_to_norm};
pub use config::{OptimSpec, OptimizerConfig};
pub use schedule::LrSchedule;
pub use sgd::{Sgd, SgdConfig};

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var};

use crate::model::grads::Grads;
use crate::{Error, Result};

/// Optimizer state: named tensors.
pub type StateDict = BTreeMap<String, Tensor>;

/// A first-order optimizer over named parameters.
pub trait Optimizer: Send {
    /// Updates every parameter that has a gradient in `grads` with learning rate `lr`.
    fn step(&mut self, grads: &Grads, lr: f64) -> Result<()>;
    /// The state needed to resume exactly.
    fn state_dict(&self) -> Result<StateDict>;
    /// Restores a state made by [`Optimizer::state_dict`] of the same parameters.
    fn load_state_dict(&mut self, state: &StateDict) -> Result<()>;
    /// The parameters this optimizer updates, with their global names.
    fn params(&self) -> &[(String, Var)];
}

/// Decoupled weight decay applies to matrices and embeddings, not to biases and norm gains
/// (minGPT's rule): parameters of rank >= 2.
pub fn decays(_name: &str, var: &Var) -> bool {
    var.rank() >= 2
}

fn step_tensor(step: u64) -> Result<Tensor> {
    Ok(Tensor::new(&[step as i64], &Device::Cpu)?)
}

fn read_step(state: &StateDict) -> Result<u64> {
    let t = state
        .get("step")
        .ok_or_else(|| Error::State("optimizer state has no `step` entry".into()))?;
    let v: Vec<i64> = t.to_dtype(DType::I64)?.flatten_all()?.to_vec1()?;
    v.first()
        .map(|s| *s as u64)
        .ok_or_else(|| Error::State("optimizer `step` entry is empty".into()))
}

/// Fails when `state` holds an entry other than `step` and `<param>.<entry>` for one of
/// `entries`: state another optimizer saved, which `optimizer` would otherwise drop unsaid.
fn only_entries(state: &StateDict, entries: &[&str], optimizer: &str) -> Result<()> {
    let foreign = state.keys().find(|k| {
        *k != "step"
            && !k
                .rsplit_once('.')
                .is_some_and(|(_, e)| entries.contains(&e))
    });
    match foreign {
        None => Ok(()),
        Some(k) => Err(Error::State(format!(
            "the optimizer state holds `{k}`, which {optimizer} does not keep (AdamW keeps \
             exp_avg and exp_avg_sq, SGD momentum_buffer): it was saved by another optimizer; \
             go on with that one (--optimizer), or start a new run"
        ))),
    }
}

/// Takes `key` from `state`, checking it has the parameter's shape.
fn state_entry(state: &StateDict, key: &str, var: &Var) -> Result<Tensor> {
    let t = state
        .get(key)
        .ok_or_else(|| Error::State(format!("optimizer state has no `{key}`")))?;
    if t.dims() != var.dims() {
        return Err(Error::State(format!(
            "`{key}` has shape {:?} but the parameter has {:?}",
            t.dims(),
            var.dims()
        )));
    }
    Ok(t.to_dtype(DType::F32)?.to_device(var.device())?)
}
