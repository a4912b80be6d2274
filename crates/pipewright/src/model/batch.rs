//! A batch of named tensors (Varuna's `get_batch_fn` dict: `input_ids`, `attention_mask`,
//! `labels`, ...), every one with the batch on dim 0, and its split into micro-batches
//! (torchgpipe's `microbatch.py`, `torch.chunk` semantics).
//!
//! The model's first stage takes the tensors its [`crate::Sequential`] names as inputs, the
//! loss the ones it names as targets; a tensor nobody names rides along unused.

use candle_core::{Device, Tensor};

use crate::{invalid, Result};

/// Named tensors sharing dim 0 (the rows), in insertion order.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    tensors: Vec<(String, Tensor)>,
    /// The host tensors [`Batch::to_device`] moved to a device, by name (see
    /// [`Batch::require_host_first`]).
    host: Vec<(String, Tensor)>,
}

impl Batch {
    /// The name a model takes its input under unless it names others.
    pub const INPUTS: &'static str = "inputs";
    /// The name the built-in losses read their targets from unless told otherwise.
    pub const TARGETS: &'static str = "targets";

    /// An empty batch.
    pub fn new() -> Self {
        Self::default()
    }

    /// The common case: one input tensor ([`Batch::INPUTS`]) and one target tensor
    /// ([`Batch::TARGETS`]).
    pub fn pair(inputs: Tensor, targets: Tensor) -> Self {
        Self::new()
            .with(Self::INPUTS, inputs)
            .with(Self::TARGETS, targets)
    }

    /// Inputs alone ([`Batch::INPUTS`]), for prediction.
    pub fn input(inputs: Tensor) -> Self {
        Self::new().with(Self::INPUTS, inputs)
    }

    /// The batch with `t` under `name` (replacing a tensor of that name).
    pub fn with(mut self, name: impl Into<String>, t: Tensor) -> Self {
        self.insert(name, t);
        self
    }

    /// Puts `t` under `name` (replacing a tensor of that name).
    pub fn insert(&mut self, name: impl Into<String>, t: Tensor) {
        let name = name.into();
        self.host.retain(|(n, _)| *n != name);
        match self.tensors.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = t,
            None => self.tensors.push((name, t)),
        }
    }

    /// The tensor under `name`.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors
            .iter()
            .find_map(|(n, t)| (n == name).then_some(t))
    }

    /// The tensor under `name`, or an error saying that `who` asks for it and what the batch
    /// holds instead.
    pub fn require(&self, name: &str, who: &str) -> Result<&Tensor> {
        self.get(name).ok_or_else(|| {
            invalid!(
                "{who} asks for the batch tensor `{name}` but the batch holds only {:?}: add \
                 `{name}` to the batch or name one it holds",
                self.names()
            )
        })
    }

    /// [`Batch::require`], but the tensor's host copy when [`Batch::to_device`] moved it from
    /// the host: what a loss reads values from (its targets' classes and count) without waiting
    /// for the device, where reading the device's copy waited for all the work queued before.
    pub fn require_host_first(&self, name: &str, who: &str) -> Result<&Tensor> {
        match self.host_copy(name) {
            Some(t) => Ok(t),
            None => self.require(name, who),
        }
    }

    /// The host copy of the tensor under `name`, if [`Batch::to_device`] moved it from the host.
    pub fn host_copy(&self, name: &str) -> Option<&Tensor> {
        self.host.iter().find_map(|(n, t)| (n == name).then_some(t))
    }

    /// Checks that the batch holds every one of `names` (see [`Batch::require`]).
    pub fn require_all(&self, names: &[String], who: &str) -> Result<()> {
        names
            .iter()
            .try_for_each(|n| self.require(n, who).map(|_| ()))
    }

    /// The names, in insertion order.
    pub fn names(&self) -> Vec<&str> {
        self.tensors.iter().map(|(n, _)| n.as_str()).collect()
    }

    /// Every (name, tensor), in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.tensors.iter().map(|(n, t)| (n.as_str(), t))
    }

    /// The number of rows (dim 0), which every tensor must share.
    pub fn rows(&self) -> Result<usize> {
        let mut rows = None;
        for (n, t) in &self.tensors {
            let r = t.dims().first().copied().ok_or_else(|| {
                invalid!("batch tensor `{n}` is a scalar: every batch tensor needs rows on dim 0")
            })?;
            match rows {
                None => rows = Some((n, r)),
                Some((first, r0)) if r0 != r => {
                    return Err(invalid!(
                        "batch tensor `{n}` has {r} rows but `{first}` has {r0}: every batch \
                         tensor needs the same rows on dim 0"
                    ))
                }
                Some(_) => {}
            }
        }
        rows.map(|(_, r)| r)
            .ok_or_else(|| invalid!("the batch holds no tensor"))
    }

    /// Rows `start .. start + len` of every tensor.
    pub fn narrow(&self, start: usize, len: usize) -> Result<Batch> {
        let rows = |ts: &[(String, Tensor)]| {
            ts.iter()
                .map(|(n, t)| Ok((n.clone(), t.narrow(0, start, len)?)))
                .collect::<Result<_>>()
        };
        Ok(Batch {
            tensors: rows(&self.tensors)?,
            host: rows(&self.host)?,
        })
    }

    /// The micro-batches of [`chunk_sizes`]`(rows, chunks)`, every tensor split alike.
    pub fn split(&self, chunks: usize) -> Result<Vec<Batch>> {
        let mut start = 0;
        chunk_sizes(self.rows()?, chunks)?
            .into_iter()
            .map(|s| {
                let b = self.narrow(start, s)?;
                start += s;
                Ok(b)
            })
            .collect()
    }

    /// Every tensor on `device` (no copy for tensors already there); the host tensors it moves
    /// are kept as their host copies ([`Batch::require_host_first`]).
    pub fn to_device(&self, device: &Device) -> Result<Batch> {
        let tensors = self
            .tensors
            .iter()
            .map(|(n, t)| Ok((n.clone(), t.to_device(device)?)))
            .collect::<Result<_>>()?;
        let mut host = self.host.clone();
        if !device.is_cpu() {
            let moved = (self.tensors.iter())
                .filter(|(n, t)| t.device().is_cpu() && self.host_copy(n).is_none());
            host.extend(moved.cloned());
        }
        Ok(Batch { tensors, host })
    }
}

/// Sizes of the micro-batches of a batch of `batch` rows split into at most `chunks`:
/// `torch.chunk` semantics, every chunk `ceil(batch / chunks)` rows but the last, so there may
/// be fewer than `chunks` of them.
pub fn chunk_sizes(batch: usize, chunks: usize) -> Result<Vec<usize>> {
    if chunks == 0 {
        return Err(invalid!("chunks must be at least 1"));
    }
    if batch == 0 {
        return Err(invalid!("cannot split an empty batch into micro-batches"));
    }
    let size = batch.div_ceil(chunks);
    let mut out = Vec::new();
    let mut left = batch;
    while left > 0 {
        let s = size.min(left);
        out.push(s);
        left -= s;
    }
    Ok(out)
}

/// Splits `t` along dim 0 into micro-batches of [`chunk_sizes`].
pub fn split(t: &Tensor, chunks: usize) -> Result<Vec<Tensor>> {
    let b = t
        .dims()
        .first()
        .copied()
        .ok_or_else(|| invalid!("a 0-d tensor has no batch dimension to split"))?;
    let mut start = 0;
    chunk_sizes(b, chunks)?
        .into_iter()
        .map(|s| {
            let c = t.narrow(0, start, s)?;
            start += s;
            Ok(c)
        })
        .collect()
}

/// The host copies on a GPU (the `cuda` build's library tests; without a GPU they fail
/// unless told to skip): kept by `to_device`, split with the batch, dropped by a replacement.
#[cfg(all(test, feature = "cuda"))]
mod gpu_tests {
    use super::*;

    #[test]
    fn a_batch_on_a_gpu_keeps_its_host_tensors_split_alike() {
        let Some(gpu) = crate::runtime::device::test_gpu() else {
            return;
        };
        let x = Tensor::arange(0u32, 12, &Device::Cpu)
            .unwrap()
            .reshape((4, 3))
            .unwrap();
        let y = Tensor::arange(0i64, 4, &Device::Cpu).unwrap();
        let b = Batch::pair(x, y).to_device(&gpu).unwrap();
        let parts = b.split(2).unwrap();
        let host = parts[1].require_host_first(Batch::TARGETS, "test").unwrap();
        assert!(host.device().is_cpu());
        assert_eq!(host.to_vec1::<i64>().unwrap(), [2, 3]);
        let on_gpu = parts[1].require(Batch::TARGETS, "test").unwrap();
        assert!(on_gpu.device().is_cuda());
        let replaced = parts[1]
            .clone()
            .with(Batch::TARGETS, Tensor::new(&[7i64, 8], &gpu).unwrap());
        let t = replaced.require_host_first(Batch::TARGETS, "test").unwrap();
        assert!(t.device().is_cuda(), "a replaced tensor has no host copy");
    }
}
