//! pystematic's `SmartDataLoader`: batches of a user's [`Dataset`], shuffled anew every epoch
//! from the seed, each data-parallel replica its own disjoint shard (PyTorch's
//! `DistributedSampler`), moved to the run's device; its position (epoch, batches taken) is
//! state that a checkpoint saves so that a resumed run goes on in the same order.

use candle_core::{Device, Tensor};
use rand::seq::SliceRandom;
use serde_json::{json, Value};

use crate::model::batch::Batch;
use crate::runtime::seed::rng_for;
use crate::{invalid, Result};

/// A data set: samples by index (PyTorch's map-style `Dataset`).
pub trait Dataset: Send + Sync {
    /// Samples in the data set.
    fn len(&self) -> usize;

    /// Whether it holds no sample.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sample `index` (below [`Dataset::len`]): named tensors of one row each (a leading
    /// dimension of 1), the same names and shapes for every sample.
    fn get(&self, index: usize) -> Result<Batch>;
}

/// Batches of a [`Dataset`] for one data-parallel replica. Iterating gives the batches of the
/// current epoch and ends with it; the next iteration is the next epoch.
pub struct SmartDataLoader<D> {
    dataset: D,
    batch_size: usize,
    shuffle: bool,
    seed: u64,
    replica: usize,
    replicas: usize,
    device: Device,
    epoch: u64,
    /// Batches taken in this epoch.
    position: usize,
    order: Vec<usize>,
}

impl<D: Dataset> SmartDataLoader<D> {
    /// Batches of `batch_size` rows (this replica's; the last of an epoch may be smaller) of
    /// `dataset` for replica `replica` of `replicas`, shuffled every epoch from `seed` when
    /// `shuffle`, on `device`. The data set's length must divide among the replicas (PyTorch
    /// pads by repeating samples, which would count some twice an epoch).
    pub fn new(
        dataset: D,
        batch_size: usize,
        shuffle: bool,
        seed: u64,
        (replica, replicas): (usize, usize),
        device: Device,
    ) -> Result<Self> {
        let n = dataset.len();
        if batch_size == 0 || replicas == 0 || replica >= replicas {
            return Err(invalid!(
                "a loader needs a positive batch size and a replica below the replica count (got batch {batch_size}, replica {replica} of {replicas})"
            ));
        }
        if n == 0 || !n.is_multiple_of(replicas) {
            return Err(invalid!(
                "a data set of {n} samples does not divide among {replicas} data-parallel replicas: trim or pad it to a multiple"
            ));
        }
        let mut l = Self {
            dataset,
            batch_size,
            shuffle,
            seed,
            replica,
            replicas,
            device,
            epoch: 0,
            position: 0,
            order: Vec::new(),
        };
        l.order = l.shard(0);
        Ok(l)
    }

    /// This replica's sample indices in epoch `epoch`: every `replicas`-th of the epoch's
    /// order, from its own offset.
    fn shard(&self, epoch: u64) -> Vec<usize> {
        let mut all: Vec<usize> = (0..self.dataset.len()).collect();
        if self.shuffle {
            all.shuffle(&mut rng_for(self.seed, &format!("loader epoch {epoch}")));
        }
        all.into_iter()
            .skip(self.replica)
            .step_by(self.replicas)
            .collect()
    }

    /// Batches in an epoch.
    pub fn batches_per_epoch(&self) -> usize {
        self.order.len().div_ceil(self.batch_size)
    }

    /// The epoch being read.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Batches taken in this epoch.
    pub fn position(&self) -> usize {
        self.position
    }

    /// Where later batches go (pystematic's `to`).
    pub fn to(&mut self, device: Device) {
        self.device = device;
    }

    /// The sample indices of the next batch, or none at the end of the epoch (which then
    /// moves to the next).
    pub fn next_indices(&mut self) -> Option<Vec<usize>> {
        let start = self.position * self.batch_size;
        if start >= self.order.len() {
            self.epoch += 1;
            self.position = 0;
            self.order = self.shard(self.epoch);
            return None;
        }
        self.position += 1;
        let end = (start + self.batch_size).min(self.order.len());
        Some(self.order[start..end].to_vec())
    }

    /// The samples `indices` as one batch on the loader's device.
    pub fn collate(&self, indices: &[usize]) -> Result<Batch> {
        let samples = indices
            .iter()
            .map(|&i| self.dataset.get(i))
            .collect::<Result<Vec<_>>>()?;
        let first = samples.first().ok_or_else(|| invalid!("an empty batch"))?;
        let mut out = Batch::new();
        for name in first.names() {
            let parts = samples
                .iter()
                .map(|s| s.require(name, "the data set's samples").cloned())
                .collect::<Result<Vec<Tensor>>>()?;
            out.insert(name, Tensor::cat(&parts, 0)?.to_device(&self.device)?);
        }
        Ok(out)
    }

    /// The loader's position (epoch and batches taken), for a checkpoint.
    pub fn state_dict(&self) -> Value {
        json!({"epoch": self.epoch, "position": self.position})
    }

    /// Goes back to a position saved by [`SmartDataLoader::state_dict`].
    pub fn load_state_dict(&mut self, state: &Value) -> Result<()> {
        let (Some(epoch), Some(position)) = (state["epoch"].as_u64(), state["position"].as_u64())
        else {
            return Err(invalid!(
                "a loader state holds epoch and position, not {state}"
            ));
        };
        self.epoch = epoch;
        self.order = self.shard(epoch);
        if position as usize > self.batches_per_epoch() {
            return Err(invalid!(
                "a loader position of {position} batches is past the {} of an epoch",
                self.batches_per_epoch()
            ));
        }
        self.position = position as usize;
        Ok(())
    }
}

impl<D: Dataset> Iterator for SmartDataLoader<D> {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Result<Batch>> {
        let indices = self.next_indices()?;
        Some(self.collate(&indices))
    }
}
