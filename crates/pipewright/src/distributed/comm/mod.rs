//! Moving tensors between ranks. Every rank runs the same program (SPMD) and learns who it is
//! from its [`Communicator`]; nothing else in the library knows whether ranks are threads in
//! one process ([`local`]), MPI processes or GPUs.
//!
//! Collectives must be called by every member of a communicator in the same order. Results of
//! reductions are identical (bit for bit) on every member and on every backend: each adds in
//! rank order by one definition ([`ordered`]), never by a library's own algorithm. Each member
//! gets them on the device of the tensor it passed. A received tensor is wherever the backend put it (the
//! sender's device for local threads, the CPU for MPI, the GPU for NCCL): receivers move it to
//! their device, which costs nothing when it is there already.

pub mod all_to_all;
mod autograd;
mod backend;
pub mod conformance;
mod group;
pub mod local;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "mpi")]
mod mpi_raw;
#[cfg(feature = "mpi")]
mod mpi_split;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod ordered;
pub mod progress;
pub mod waited;
#[cfg(any(feature = "mpi", feature = "nccl"))]
pub mod wire;

pub(crate) use autograd::{precomputed, precomputed2, precomputed3};
pub use backend::Backend;
pub use group::Group;

use candle_core::Tensor;

use crate::distributed::topology::{Axis, Topology};
use crate::Result;

/// How a reduction combines the members' tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// The elementwise sum.
    Sum,
    /// The elementwise maximum.
    Max,
    /// The sum divided by the number of members.
    Avg,
}

/// User tags must be below this (MPI guarantees only 2^15 tags; Open MPI gives far more).
pub const MAX_TAG: u64 = 1 << 20;

/// A request in flight: [`Pending::wait`] finishes it.
pub struct Pending<T>(Box<dyn FnOnce() -> Result<T> + Send>);

impl<T: Send + 'static> Pending<T> {
    /// A request that [`Pending::wait`] finishes by calling `f` (which waits for whatever the
    /// engine started: a thread, a mailbox, a progress thread's reply).
    pub fn new(f: impl FnOnce() -> Result<T> + Send + 'static) -> Self {
        Self(Box::new(f))
    }

    /// A request already complete with `r` (an engine that finished it when it was started).
    pub fn ready(r: Result<T>) -> Self {
        Self::new(move || r)
    }

    /// Blocks until the operation is complete.
    pub fn wait(self) -> Result<T> {
        (self.0)()
    }
}

/// The ranks of one group and the operations between them.
pub trait Communicator: Send + Sync {
    /// This rank within the communicator, `0..size`.
    fn rank(&self) -> usize;
    /// Number of members.
    fn size(&self) -> usize;
    /// Rank 0 (pystematic's `is_master`).
    fn is_master(&self) -> bool {
        self.rank() == 0
    }
    /// Name of the backend (`local`, `mpi`, `nccl`).
    fn backend(&self) -> &'static str;

    /// Sends `t` (any shape and dtype) to member `dst`; `tag` (< [`MAX_TAG`]) matches it with
    /// the receive. Returns once the tensor is handed over.
    fn send(&self, t: &Tensor, dst: usize, tag: u64) -> Result<()>;
    /// Receives the next tensor sent by `src` with `tag`.
    fn recv(&self, src: usize, tag: u64) -> Result<Tensor>;
    /// Starts a send; the tensor may not be changed in place until the handle is waited on.
    fn isend(&self, t: &Tensor, dst: usize, tag: u64) -> Result<Pending<()>>;
    /// Starts a receive.
    fn irecv(&self, src: usize, tag: u64) -> Result<Pending<Tensor>>;

    /// Every member gets the reduction of every member's `t` (same shape and dtype everywhere).
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;
    /// Starts [`Communicator::all_reduce`] and returns at once, so the reduction travels while
    /// the caller computes (gradient sums during the backward). The same bits as the blocking
    /// call. Members start their collectives, blocking or not, in the same order; they may wait
    /// on several in flight in any order. By default it completes before it returns (an engine
    /// with no way to progress in the background: overlap then hides nothing, but is correct);
    /// the local backend posts and reduces at the wait, MPI runs it on a progress thread
    /// ([`progress::Progress`]).
    fn iall_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Pending<Tensor>> {
        Ok(Pending::ready(self.all_reduce(t, op)))
    }
    /// Member `root` gets the reduction of every member's `t` (the others get `None`), the
    /// same bits [`Communicator::all_reduce`] gives: it is computed as that, and kept by the
    /// root alone.
    fn reduce(&self, t: &Tensor, op: ReduceOp, root: usize) -> Result<Option<Tensor>> {
        if root >= self.size() {
            return Err(crate::Error::Comm(format!(
                "rank {}: reduce names root {root}, outside this group of {} ranks",
                self.rank(),
                self.size()
            )));
        }
        let r = self.all_reduce(t, op)?;
        Ok((self.rank() == root).then_some(r))
    }
    /// Every member gets every member's tensor, in rank order (shapes may differ).
    fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>>;
    /// Starts [`Communicator::all_gather`] (ZeRO-3's next layer fetched while this one
    /// computes), as [`Communicator::iall_reduce`] starts an all-reduce.
    fn iall_gather(&self, t: &Tensor) -> Result<Pending<Vec<Tensor>>> {
        Ok(Pending::ready(self.all_gather(t)))
    }
    /// Reduces, then member `r` keeps part `r` of `size` equal parts along dim 0.
    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;
    /// Starts [`Communicator::reduce_scatter`] (ZeRO-2's gradient shards during the
    /// backward), as [`Communicator::iall_reduce`] starts an all-reduce.
    fn ireduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Pending<Tensor>> {
        Ok(Pending::ready(self.reduce_scatter(t, op)))
    }
    /// Every member gets `root`'s tensor; the others pass a tensor of the same shape and dtype.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;
    /// Member `r` gets part `r` of every member's `parts`, in rank order (torch's
    /// `all_to_all`): each member passes one part per member, all of one dtype with the same
    /// dims after the first; the rows may differ, zero included (expert parallelism's dispatch
    /// and combine). Every member checks the same facts and so reports the same error
    /// ([`all_to_all::Plan`]). By default through [`Communicator::all_gather`]
    /// ([`all_to_all::through_all_gather`]); the local, MPI and NCCL backends exchange natively.
    fn all_to_all(&self, parts: &[Tensor]) -> Result<Vec<Tensor>> {
        all_to_all::through_all_gather(self, parts)
    }
    /// Returns once every member has called it.
    fn barrier(&self) -> Result<()>;
    /// A communicator over `members` (ranks of this communicator, in the order they will have);
    /// this rank must be one of them, and every member calls it (non-members need not).
    fn split(&self, members: &[usize]) -> Result<Box<dyn Communicator>>;
}

/// Sizes candle's CPU thread pools for `ranks` ranks sharing this machine's cores (ranks as
/// threads of one process, or MPI processes on one node): `RAYON_NUM_THREADS` (which candle
/// and its matmul read) becomes cores / ranks, at least 1, unless the user set it. Oversubscribed
/// pools spin against each other: 4 ranks on 2 cores train 20 % faster with one thread each.
/// Left unset, candle's matrix product reads `/proc/cpuinfo` on every call to count the cores
/// (a test of small layouts spent most of its time there). Call it before the first tensor
/// operation of the process ([`local::run`], the MPI backend and
/// [`SerialTrainer::new`](crate::engine::serial::SerialTrainer::new) do); returns the threads per pool.
pub fn size_thread_pools(ranks: usize) -> usize {
    if let Some(n) = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|n| *n > 0)
    {
        return n;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let n = (cores / ranks.max(1)).max(1);
    std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    n
}

/// The communicator of this rank's `axis` group of `topo` (`comm` spans the whole world).
pub fn axis_group(
    comm: &dyn Communicator,
    topo: &Topology,
    axis: Axis,
) -> Result<Box<dyn Communicator>> {
    topo.layout().check_world(comm.size())?;
    comm.split(&topo.group(comm.rank(), axis)?)
}

/// pystematic's `broadcast_from_master`: rank 0's value everywhere.
pub fn broadcast_from_master(comm: &dyn Communicator, t: &Tensor) -> Result<Tensor> {
    comm.broadcast(t, 0)
}

/// Shape and dtype of `t`, for error messages.
pub fn describe(t: &Tensor) -> String {
    describe_parts(t.dims(), t.dtype())
}

fn describe_parts(dims: &[usize], dtype: candle_core::DType) -> String {
    format!("{dims:?} {dtype:?}")
}

/// Checks that every member passed the same shape and dtype as member `reference`; the
/// message names the first member that differs. `parts[r]` is member r's (shape, dtype).
pub fn check_agree(
    op: &str,
    parts: &[(Vec<usize>, candle_core::DType)],
    reference: usize,
) -> std::result::Result<(), String> {
    let (rd, rt) = &parts[reference];
    for (r, (d, t)) in parts.iter().enumerate() {
        if d != rd || t != rt {
            let (what, whom) = if op == "broadcast" {
                ("expects", format!("root {reference} sends"))
            } else {
                ("passed", format!("rank {reference} passed"))
            };
            return Err(format!(
                "{op}: rank {r} {what} {} but {whom} {}; every member must use the same shape and dtype",
                describe_parts(d, *t),
                describe_parts(rd, *rt)
            ));
        }
    }
    Ok(())
}

/// Checks that every member passed the dtype of member 0 (all_gather lets shapes differ).
pub fn check_same_dtype(
    parts: &[(Vec<usize>, candle_core::DType)],
) -> std::result::Result<(), String> {
    match parts
        .iter()
        .enumerate()
        .find(|(_, (_, dt))| *dt != parts[0].1)
    {
        Some((r, (d, dt))) => Err(format!(
            "all_gather: rank {r} passed {} but rank 0 passed {}; dtypes must agree",
            describe_parts(d, *dt),
            describe_parts(&parts[0].0, parts[0].1)
        )),
        None => Ok(()),
    }
}
