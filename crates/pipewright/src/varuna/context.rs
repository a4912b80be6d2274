//! What context parallelism changes in a Varuna step: each rank of a ring takes its slice of
//! every sequence of its replica's rows (see [`crate::context_parallel::Chunks`]), and what
//! evaluation gives back is summed or joined over the ring.

use candle_core::{Device, Tensor};

use super::Varuna;
use crate::batch::Batch;
use crate::comm::ReduceOp;
use crate::context_parallel::Chunks;
use crate::{invalid, Result};

impl Varuna {
    /// `batch` on this rank's device, each tensor cut to this rank's slice of the sequence
    /// (dim 1) under context parallelism.
    pub(super) fn local_batch(&self, batch: &Batch) -> Result<Batch> {
        let batch = batch.to_device(&self.opts.device)?;
        let me = Chunks::of(&self.cp);
        if !me.is_split() {
            return Ok(batch);
        }
        let mut out = Batch::new();
        for (name, t) in batch.iter() {
            if t.rank() < 2 {
                return Err(invalid!(
                    "context parallelism splits every batch tensor along dim 1 (the sequence), \
                     but `{name}` has shape {:?}: give per-token tensors (batch, sequence, ...) \
                     or use cp 1",
                    t.dims()
                ));
            }
            me.check_len(t.dim(1)?)?;
            out.insert(name, me.take(t, 1)?);
        }
        Ok(out)
    }

    /// A loss sum and count of this rank's slice, summed over the ring (the replica's).
    pub(super) fn sum_over_ring(&self, (sum, count): (f64, usize)) -> Result<(f64, usize)> {
        if self.cp.size() == 1 {
            return Ok((sum, count));
        }
        let t = Tensor::new(&[sum, count as f64], &Device::Cpu)?;
        let v = self.cp.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f64>()?;
        Ok((v[0], v[1].round() as usize))
    }

    /// The model output over whole sequences from this rank's slice (dim 1), joined over the
    /// ring.
    pub(super) fn whole_sequence(&self, out: &Tensor) -> Result<Tensor> {
        if self.cp.size() == 1 {
            return Ok(out.clone());
        }
        let parts = self.cp.all_gather(&out.contiguous()?)?;
        let device = out.device();
        let parts = parts
            .iter()
            .map(|p| p.to_device(device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Chunks::join(&parts, 1)
    }
}
