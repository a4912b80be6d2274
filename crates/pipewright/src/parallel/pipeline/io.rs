//! A rank's receives and sends around its actions: timed receives (their wait is traced apart
//! from compute), the first stage's input from the batch or a neighbour's activation, skip
//! tensors in and out, and the check that what crosses a cut keeps its arity.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Instant;

use candle_core::{Tensor, Var};

use super::stage::PipelineStage;
use super::transfer::{recv_activation, Received, Tags};
use crate::distributed::comm::Pending;
use crate::model::batch::Batch;
use crate::model::Activation;
use crate::{invalid, Result};

impl PipelineStage {
    /// A receive whose waiting time counts as the running action's wait (see
    /// [`TraceEvent::wait_us`]).
    pub(super) fn recv_timed(&self, src: usize, tag: u64) -> Result<Tensor> {
        let t0 = Instant::now();
        let t = self.comm.recv(src, tag)?;
        self.waited_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(t)
    }

    /// Receives the skip tensors that model stage `k` pops from earlier stages.
    pub(super) fn import_skips(&self, k: usize, mb: usize) -> Result<Vec<(usize, Var)>> {
        self.skips
            .into_stage(k)
            .map(|(i, r)| {
                let tag = Tags::tensor(self.tags.skip(mb, i, false));
                let t = self.recv_timed(self.rank_of(r.from), tag)?;
                Ok((i, Var::from_tensor(&t.to_device(&self.device)?)?))
            })
            .collect()
    }

    /// Sends the skip tensors model stage `k` exports to the stages that pop them.
    pub(super) fn export_skips(
        &self,
        mb: usize,
        exports: &[(usize, Tensor)],
        sends: &mut Vec<Pending<()>>,
    ) -> Result<()> {
        for (i, t) in exports {
            let to = self.rank_of(self.skips.routes()[*i].to);
            let tag = Tags::tensor(self.tags.skip(mb, *i, false));
            sends.push(self.comm.isend(t, to, tag)?);
        }
        Ok(())
    }

    /// The first stage's input for micro-batch `mb`, or the previous stage's output.
    pub(super) fn stage_input(&self, k: usize, mb: usize, batch: &Batch) -> Result<Received> {
        if k == 0 {
            let x = Activation::from_batch(batch, self.input_names(), "model stage 0")?;
            return Ok(Received {
                activation: x,
                vars: Vec::new(),
            });
        }
        let recv = |src, tag| self.recv_timed(src, tag);
        let msg = self.tags.activation(mb, k - 1, false);
        Received::new(recv_activation(
            &recv,
            self.rank_of(k - 1),
            msg,
            &self.device,
        )?)
    }
}

/// Checks that model stage `k` passes the same kind of activation (arity, tuple or not) for
/// micro-batch `mb` as for the first micro-batch of the step.
pub(super) fn check_arity(
    seen: &mut HashMap<usize, (usize, usize, bool)>,
    k: usize,
    mb: usize,
    out: &Activation,
) -> Result<()> {
    let (first, n, tuple) = *seen.entry(k).or_insert((mb, out.arity(), out.is_tuple()));
    if (n, tuple) != (out.arity(), out.is_tuple()) {
        return Err(invalid!(
            "model stage {k} passes {} for micro-batch {mb} but {} for micro-batch {first}: what \
             crosses a cut point must keep its arity",
            describe(out.arity(), out.is_tuple()),
            describe(n, tuple)
        ));
    }
    Ok(())
}

fn describe(n: usize, tuple: bool) -> String {
    if tuple {
        format!("a tuple of {n} tensors")
    } else {
        "one tensor".into()
    }
}
