//! A rank's communication thread: collectives started with [`Communicator::iall_reduce`],
//! [`Communicator::ireduce_scatter`] or [`Communicator::iall_gather`] run there, one after another in the order they were
//! started, on a communicator of their own (a split of the same members, so they never
//! interleave with the blocking collectives the rank's own thread runs meanwhile), while the
//! rank computes. The engine of an engine that has no non-blocking collectives it can use:
//! MPI's `MPI_Iallreduce` sums by its own algorithm, and every reduction here adds in rank
//! order ([`super::ordered`]), so Open MPI's ranks run the blocking, ordered reduction on this
//! thread (MPI is initialised with `MPI_THREAD_MULTIPLE`).
//!
//! Every member starts its non-blocking collectives in the same order (the rule of every
//! collective), so the threads of the members run them in the same order too.

use std::sync::mpsc;
use std::thread::JoinHandle;

use candle_core::Tensor;

use super::{Communicator, Pending, ReduceOp};
use crate::{Error, Result};

type Job = Box<dyn FnOnce(&dyn Communicator) + Send>;

/// The communication thread of one communicator of one rank.
pub struct Progress {
    jobs: Option<mpsc::Sender<Job>>,
    thread: Option<JoinHandle<()>>,
}

impl Progress {
    /// Starts the thread, which runs the collectives on `own` (a communicator over the same
    /// members as the one it serves, made for it alone).
    pub fn new(own: Box<dyn Communicator>) -> Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let thread = std::thread::Builder::new()
            .name(format!("pipewright-progress-{}", own.rank()))
            .spawn(move || {
                for job in rx {
                    job(own.as_ref());
                }
            })
            .map_err(|e| Error::Comm(format!("cannot start a communication thread: {e}")))?;
        Ok(Self {
            jobs: Some(tx),
            thread: Some(thread),
        })
    }

    /// Runs `f` on the thread after every collective started before it; the handle gives its
    /// result.
    pub fn start<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn Communicator) -> Result<T> + Send + 'static,
    ) -> Result<Pending<T>> {
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move |c| {
            // The waiter may be gone (its rank failed): nothing to tell then.
            let _ = tx.send(f(c));
        });
        let gone = || Error::Comm("the communication thread has stopped".into());
        self.jobs
            .as_ref()
            .ok_or_else(gone)?
            .send(job)
            .map_err(|_| gone())?;
        Ok(Pending::new(move || rx.recv().map_err(|_| gone())?))
    }

    /// [`Communicator::all_reduce`] of `t` on the thread.
    pub fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Pending<Tensor>> {
        let t = t.clone();
        self.start(move |c| c.all_reduce(&t, op))
    }

    /// [`Communicator::reduce_scatter`] of `t` on the thread.
    pub fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Pending<Tensor>> {
        let t = t.clone();
        self.start(move |c| c.reduce_scatter(&t, op))
    }

    /// [`Communicator::all_gather`] of `t` on the thread.
    pub fn all_gather(&self, t: &Tensor) -> Result<Pending<Vec<Tensor>>> {
        let t = t.clone();
        self.start(move |c| c.all_gather(&t))
    }
}

impl Drop for Progress {
    /// Lets the thread finish what was started, then joins it.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
