//! [`ring_shift`]: a tensor one step around the context-parallel ring, as an autograd op.
//!
//! Forward: rank `r` sends its tensor to rank `r + 1` and gets rank `r - 1`'s. Backward: the
//! gradient goes the other way, one step back (rank `r` sends to `r - 1`, gets `r + 1`'s), so
//! that a block's gradient, accumulated on every rank that used it, ends where the block came
//! from. Every rank of the ring calls it the same number of times, in the same order, forward
//! and backward (the ranks run the same layers on the same schedule).

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use crate::comm::TpGroup;
use crate::{Error, Result};

/// Tags of the ring's messages (forward and backward apart, below user tags' limit).
const FORWARD_TAG: u64 = 0xC0F;
const BACKWARD_TAG: u64 = 0xC0B;

/// Sends `t` to the member `by` places on and receives from the member `by` places back.
fn shift(t: &Tensor, ring: &TpGroup, forward: bool, tag: u64) -> Result<Tensor> {
    let comm = ring
        .comm()
        .ok_or_else(|| Error::Comm("a ring shift needs a ring of more than one rank".into()))?;
    let n = comm.size();
    let r = comm.rank();
    let (to, from) = if forward {
        ((r + 1) % n, (r + n - 1) % n)
    } else {
        ((r + n - 1) % n, (r + 1) % n)
    };
    let t = t.contiguous()?;
    // Started before the receive: every rank sends at once (a blocking send would deadlock).
    let sent = comm.isend(&t, to, tag)?;
    let got = comm.recv(from, tag)?.to_device(t.device())?;
    sent.wait()?;
    Ok(got)
}

struct Shift {
    ring: TpGroup,
    value: Mutex<Option<Tensor>>,
}

impl Shift {
    fn take(&self) -> candle_core::Result<Tensor> {
        self.value
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .ok_or_else(|| candle_core::Error::Msg("ring-shift: run twice".into()))
    }
}

impl CustomOp1 for Shift {
    fn name(&self) -> &'static str {
        "ring-shift"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        crate::storage::copy_of(&self.take()?, self.name(), crate::storage::cpu)
    }

    fn cuda_fwd(
        &self,
        _s: &candle_core::CudaStorage,
        _l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::storage::copy_of(&self.take()?, self.name(), crate::storage::cuda)
    }

    fn bwd(
        &self,
        _arg: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> candle_core::Result<Option<Tensor>> {
        let g = shift(grad, &self.ring, false, BACKWARD_TAG)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        Ok(Some(g))
    }
}

/// The previous rank's `t` (its gradient goes back to that rank in the backward). In a ring
/// of one, `t` itself.
pub fn ring_shift(t: &Tensor, ring: &TpGroup) -> Result<Tensor> {
    if ring.size() == 1 {
        return Ok(t.clone());
    }
    let got = shift(&t.detach(), ring, true, FORWARD_TAG)?;
    let op = Shift {
        ring: ring.clone(),
        value: Mutex::new(Some(got)),
    };
    Ok(t.apply_op1(op)?)
}
