//! What a trainer owns, as a checkpoint sees it: f32 parameters (or masters) with their
//! splits, the optimizer's state split as its parameters, and buffers. One code path takes it
//! into a [`Snapshot`] and puts it back from a [`Reader`], for the Varuna step (any layout)
//! and the serial trainer (the 1 x 1 x 1 case) alike.

use candle_core::{Tensor, Var};

use super::format::EntryKind;
use super::load::Reader;
use super::save::{Held, Snapshot, TensorPart};
use crate::model::nn::optim::StateDict;
use crate::parallel::tensor_parallel::Shard;
use crate::{Error, Result};

/// One rank's trainable state.
pub struct Owned<'a> {
    /// World rank.
    pub rank: usize,
    /// Parameters in f32 (the masters under low precision), with global names.
    pub params: &'a [(String, Var)],
    /// How the sharded ones are split.
    pub shards: Vec<(String, Shard)>,
    /// Buffers (BatchNorm running statistics), whole.
    pub buffers: Vec<(String, Var)>,
    /// This rank writes the whole tensors it holds (first tensor-parallel rank of the first
    /// replica).
    pub write_whole: bool,
    /// This rank writes its shards (first replica).
    pub write_shards: bool,
    /// The parameters that are this rank's experts (expert parallelism: the ranks of the
    /// first expert group hold every expert between them, each its own).
    pub experts: Vec<String>,
    /// This rank writes its whole experts (first tensor-parallel rank of the first expert
    /// group).
    pub write_experts: bool,
    /// This rank writes its experts' shards (the first expert group).
    pub write_expert_shards: bool,
}

impl Owned<'_> {
    /// How this rank holds parameter `name`, and its whole shape when split.
    pub fn split(&self, name: &str) -> (TensorPart, Option<Vec<usize>>) {
        match self.shards.iter().find(|(n, _)| n == name) {
            Some((_, s)) => (
                TensorPart {
                    axis: s.axis,
                    stride: s.stride,
                    index: s.index,
                    count: s.count,
                },
                Some(s.whole.clone()),
            ),
            None => (TensorPart::WHOLE, None),
        }
    }

    /// Every parameter's global name and whole shape.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.params
            .iter()
            .map(|(n, v)| {
                (
                    n.clone(),
                    self.split(n).1.unwrap_or_else(|| v.dims().to_vec()),
                )
            })
            .collect()
    }

    /// Copies of what this rank writes (parameters, the optimizer's `state` over them,
    /// buffers), taken off the training tensors so training may go on while they are written.
    pub fn snapshot(&self, state: &StateDict) -> Result<Snapshot> {
        let mut tensors = Vec::new();
        for (name, var) in self.params {
            let (split, whole) = self.split(name);
            let writes = if self.experts.contains(name) {
                match whole {
                    Some(_) => self.write_expert_shards,
                    None => self.write_experts,
                }
            } else if whole.is_some() {
                self.write_shards
            } else {
                self.write_whole
            };
            if !writes {
                continue;
            }
            let whole = whole.unwrap_or_else(|| var.dims().to_vec());
            let mut held = |name: &str, kind: EntryKind, t: &Tensor| -> Result<()> {
                tensors.push(Held::new(name, kind, whole.clone(), split, t)?);
                Ok(())
            };
            held(name, EntryKind::Param, var.as_tensor())?;
            for key in optimizer_keys(state, name) {
                held(&key, EntryKind::Optimizer, &state[&key])?;
            }
        }
        if self.write_whole {
            for (name, b) in &self.buffers {
                let whole = b.dims().to_vec();
                tensors.push(Held::new(
                    name,
                    EntryKind::Buffer,
                    whole,
                    TensorPart::WHOLE,
                    b.as_tensor(),
                )?);
            }
        }
        Ok(Snapshot {
            rank: self.rank,
            tensors,
            params: self.param_shapes(),
        })
    }

    /// Reads this rank's part of every parameter and buffer and the optimizer state (its
    /// step `optimizer_step`) from `r`, in this rank's split, dtype and device; nothing changes
    /// until [`Restored::apply`].
    pub fn read(&self, r: &Reader, optimizer_step: u64) -> Result<Restored> {
        let mut state: StateDict = StateDict::new();
        state.insert(
            "step".into(),
            Tensor::new(&[optimizer_step as i64], &candle_core::Device::Cpu)?,
        );
        let mut values = Vec::new();
        for (name, var) in self.params {
            let (split, _) = self.split(name);
            let t = r.read(name, split)?;
            if t.dims() != var.dims() {
                return Err(Error::State(format!(
                    "`{name}` reads as {:?} but this rank holds {:?}",
                    t.dims(),
                    var.dims()
                )));
            }
            values.push((
                var.clone(),
                t.to_dtype(var.dtype())?.to_device(var.device())?,
            ));
            for key in r.entries_of(name, EntryKind::Optimizer) {
                state.insert(key.clone(), r.read(&key, split)?.to_device(var.device())?);
            }
        }
        for (name, b) in &self.buffers {
            let t = r.read_whole(name)?;
            values.push((b.clone(), t.to_dtype(b.dtype())?.to_device(b.device())?));
        }
        Ok(Restored { values, state })
    }
}

/// What [`Owned::read`] read, to put in place.
pub struct Restored {
    values: Vec<(Var, Tensor)>,
    state: StateDict,
}

impl Restored {
    /// Gives the optimizer state read to `load` (an optimizer's `load_state_dict`) and only
    /// then (it may refuse) sets the parameters and buffers.
    pub fn apply(self, load: impl FnOnce(&StateDict) -> Result<()>) -> Result<()> {
        load(&self.state)?;
        for (var, t) in self.values {
            var.set(&t)?;
        }
        Ok(())
    }
}

/// The optimizer-state keys of parameter `name` (`<name>.<entry>`, no further dot).
fn optimizer_keys(state: &StateDict, name: &str) -> Vec<String> {
    let p = format!("{name}.");
    state
        .keys()
        .filter(|k| k.strip_prefix(&p).is_some_and(|r| !r.contains('.')))
        .cloned()
        .collect()
}
