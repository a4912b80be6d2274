//! What context parallelism changes in a Varuna step: each rank of a ring takes its slice of
//! every sequence of its replica's rows (see [`crate::parallel::context_parallel::Chunks`]), and what
//! evaluation gives back is summed or joined over the ring.

use candle_core::{Device, Tensor};

use super::Varuna;
use crate::distributed::comm::ReduceOp;
use crate::model::batch::Batch;
use crate::parallel::context_parallel::Chunks;
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
        self.cut(&batch, me)
    }

    /// [`Varuna::local_batch`] of inputs alone, whose sequences are first padded on the right
    /// (with zeros) to a length that the ring and sequence parallelism split; returns the
    /// batch and the length before padding. Exact for causal models (no position sees a later
    /// one), the only kind ring attention runs: the output's first positions are those of the
    /// unpadded inputs.
    pub(super) fn local_inputs(&self, batch: &Batch) -> Result<(Batch, Option<usize>)> {
        let me = Chunks::of(&self.cp);
        let n = self
            .topo
            .layout()
            .sequence_multiple(self.opts.spec.parallel.sequence_parallel);
        if n == 1 {
            return Ok((batch.to_device(&self.opts.device)?, None));
        }
        let mut padded = Batch::new();
        let mut len = None;
        for (name, t) in batch.iter() {
            let t = t.to_device(&self.opts.device)?;
            if t.rank() >= 2 {
                let l = t.dim(1)?;
                len = Some(l);
                let more = l.div_ceil(n).max(1) * n - l;
                padded.insert(
                    name,
                    if more > 0 {
                        t.pad_with_zeros(1, 0, more)?
                    } else {
                        t
                    },
                );
            } else {
                padded.insert(name, t);
            }
        }
        let local = if me.is_split() {
            self.cut(&padded, me)?
        } else {
            padded
        };
        Ok((local, len))
    }

    fn cut(&self, batch: &Batch, me: Chunks) -> Result<Batch> {
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
    /// ring, cut back to `len` positions when the inputs were padded.
    pub(super) fn whole_sequence(&self, out: &Tensor, len: Option<usize>) -> Result<Tensor> {
        let whole = if self.cp.size() == 1 {
            out.clone()
        } else {
            self.join_ring(out)?
        };
        match len {
            Some(l) if l < whole.dim(1)? => Ok(whole.narrow(1, 0, l)?),
            _ => Ok(whole),
        }
    }

    fn join_ring(&self, out: &Tensor) -> Result<Tensor> {
        let parts = self.cp.all_gather(&out.contiguous()?)?;
        let device = out.device();
        let parts = parts
            .iter()
            .map(|p| p.to_device(device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        Chunks::join(&parts, 1)
    }
}
