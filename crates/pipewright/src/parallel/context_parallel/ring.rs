//! `pass_on`: a tensor one step around the context-parallel ring.
//!
//! Rank `r` sends its tensor to rank `r + 1` and gets rank `r - 1`'s. Every rank of the ring
//! calls it the same number of times, in the same order, forward and backward (the ranks run
//! the same layers on the same schedule), with a tag per use so that a message cannot be
//! taken for another.

use candle_core::Tensor;

use crate::distributed::comm::Group;
use crate::Result;

/// Sends `t` one place on around the ring and returns what came from one place back (in a
/// ring of one, `t` itself).
pub(crate) fn pass_on(t: &Tensor, ring: &Group, tag: u64) -> Result<Tensor> {
    let Some(comm) = ring.comm() else {
        return Ok(t.clone());
    };
    let n = comm.size();
    if n == 1 {
        return Ok(t.clone());
    }
    let r = comm.rank();
    let t = t.contiguous()?;
    // Started before the receive: every rank sends at once (a blocking send would deadlock).
    let sent = comm.isend(&t, (r + 1) % n, tag)?;
    let got = comm.recv((r + n - 1) % n, tag)?.to_device(t.device())?;
    sent.wait()?;
    Ok(got)
}
