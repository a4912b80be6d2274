//! [`ring_shift`]: a tensor one step around the context-parallel ring, as an autograd op.
//!
//! Forward: rank `r` sends its tensor to rank `r + 1` and gets rank `r - 1`'s. Backward: the
//! gradient goes the other way, one step back (rank `r` sends to `r - 1`, gets `r + 1`'s), so
//! that a block's gradient, accumulated on every rank that used it, ends where the block came
//! from. Every rank of the ring calls it the same number of times, in the same order, forward
//! and backward (the ranks run the same layers on the same schedule).

use candle_core::Tensor;

use crate::comm::{precomputed, TpGroup};
use crate::{Error, Result};

/// Tags of the ring's messages (forward and backward apart, below user tags' limit).
const FORWARD_TAG: u64 = 0xC0F;
const BACKWARD_TAG: u64 = 0xC0B;

/// Sends `t` one place on around the ring and receives from one place back (`forward`), or the
/// other way.
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

/// The previous rank's `t` (its gradient goes back to that rank in the backward). In a ring
/// of one, `t` itself.
pub fn ring_shift(t: &Tensor, ring: &TpGroup) -> Result<Tensor> {
    if ring.size() == 1 {
        return Ok(t.clone());
    }
    let got = shift(&t.detach(), ring, true, FORWARD_TAG)?;
    let ring = ring.clone();
    precomputed(t, got, "ring-shift", move |grad| {
        shift(grad, &ring, false, BACKWARD_TAG)
    })
}
