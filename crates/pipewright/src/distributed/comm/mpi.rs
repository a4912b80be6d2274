//! Open MPI backend (cargo feature `mpi`): one process per rank under `mpirun`; rank and size
//! come from MPI. Tensors travel as raw bytes straight from and into CPU storage (no
//! serialisation, no extra copy on the receiving side); point-to-point messages carry a small
//! header (dtype and shape) first. Collectives use MPI's own (`MPI_Allgatherv`, ...) after an
//! exchange of headers that lets every rank report a shape or dtype mismatch identically.
//! Reductions add nothing in MPI: `MPI_Alltoallv` hands each rank the parts it reduces, which
//! it adds in rank order ([`super::ordered`]), and `MPI_Allgatherv` shares the results, so the
//! bits do not depend on the algorithm Open MPI picks for a CPU, a size or a rank count. GPU
//! tensors go through host memory (this MPI is not CUDA-aware;
//! [`wire::to_host`](super::wire::to_host) warns once), and the results of collectives come
//! back on the device of their input.
//!
//! MPI's default error handler is fatal: a rank that dies makes `mpirun` end the job and
//! name it. A rank whose program returns an error should call [`Mpi::abort`] so the others do
//! not wait.

use std::ops::Range;
use std::sync::{Arc, OnceLock};

use candle_core::{DType, Tensor};
use mpi::datatype::{Partition, PartitionMut};
use mpi::topology::SimpleCommunicator;
use mpi::traits::{Communicator as _, CommunicatorCollectives, Destination, Root, Source};
use mpi::Threading;

use super::mpi_raw::{count_i32, recv_new, settle};
use super::progress::Progress;
use super::wire::{
    header, parse_header, reduce_plan, tensor_from_bytes, to_host, with_bytes, Buf, HEADER,
};
use super::{
    all_to_all, check_agree, check_same_dtype, ordered, Communicator, Pending, ReduceOp, MAX_TAG,
};
use crate::{Error, Result};

/// MPI itself: initialised with `MPI_THREAD_MULTIPLE`, finalised when dropped.
pub struct Mpi {
    _universe: mpi::environment::Universe,
}

impl Mpi {
    /// Initialises MPI and returns the world communicator.
    pub fn init() -> Result<(Mpi, MpiComm)> {
        let (universe, threading) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| Error::Comm("MPI was already initialised in this process".into()))?;
        if threading != Threading::Multiple {
            return Err(Error::Comm(format!(
                "this MPI library offers {threading:?} threading, pipewright needs Multiple \
                 (MPI_THREAD_MULTIPLE) for non-blocking sends: install Open MPI built with it"
            )));
        }
        crate::runtime::memory::keep_freed_memory();
        let comm = MpiComm::new(universe.world());
        Ok((
            Mpi {
                _universe: universe,
            },
            comm,
        ))
    }

    /// Ends every rank of the job (after an error on this rank), with `code` as exit status.
    pub fn abort(code: i32) -> ! {
        SimpleCommunicator::world().abort(code)
    }
}

struct Inner(SimpleCommunicator);
// SAFETY: MPI is initialised with MPI_THREAD_MULTIPLE (checked in `Mpi::init`), so a
// communicator handle may be used from several threads at once.
unsafe impl Send for Inner {}
unsafe impl Sync for Inner {}

/// One rank of an MPI communicator.
pub struct MpiComm {
    inner: Arc<Inner>,
    rank: usize,
    size: usize,
    /// The thread the non-blocking collectives run on, on a communicator of their own (made
    /// by the first one, a collective every member reaches at the same point).
    progress: OnceLock<Progress>,
    /// Whether the reductions' data movements wait by testing and sleeping ([`settle`]): the
    /// communication thread's communicator, whose waits must leave the cores to the rank.
    polite: bool,
}

impl MpiComm {
    pub(super) fn new(comm: SimpleCommunicator) -> Self {
        let (rank, size) = (comm.rank() as usize, comm.size() as usize);
        Self {
            inner: Arc::new(Inner(comm)),
            rank,
            size,
            progress: OnceLock::new(),
            polite: false,
        }
    }

    /// This rank's handle once more, for a thread of its own (a send or receive in flight).
    fn alias(&self) -> MpiComm {
        MpiComm {
            inner: self.inner.clone(),
            rank: self.rank,
            size: self.size,
            progress: OnceLock::new(),
            polite: false,
        }
    }

    /// The communication thread, started by the first non-blocking collective.
    fn progress(&self) -> Result<&Progress> {
        if let Some(p) = self.progress.get() {
            return Ok(p);
        }
        let mut own = self.split_mpi(&(0..self.size).collect::<Vec<_>>())?;
        own.polite = true;
        let _ = self.progress.set(Progress::new(Box::new(own))?);
        Ok(self.progress.get().expect("set just above"))
    }

    /// `t` reduced by `start` on the communication thread, from and back to its device.
    fn on_progress(
        &self,
        t: &Tensor,
        start: impl FnOnce(&Progress, &Tensor) -> Result<Pending<Tensor>>,
    ) -> Result<Pending<Tensor>> {
        let here = t.device().clone();
        let h = start(self.progress()?, &to_host(t, "mpi")?)?;
        Ok(Pending::new(move || Ok(h.wait()?.to_device(&here)?)))
    }

    pub(super) fn comm(&self) -> &SimpleCommunicator {
        &self.inner.0
    }

    fn peer(&self, r: usize, what: &str, tag: Option<u64>) -> Result<i32> {
        if r >= self.size {
            return Err(Error::Comm(format!(
                "rank {}: {what} names rank {r}, outside this group of {} ranks",
                self.rank, self.size
            )));
        }
        if let Some(tag) = tag {
            if tag >= MAX_TAG {
                return Err(Error::Comm(format!(
                    "tag {tag} is too large: use tags below {MAX_TAG}"
                )));
            }
        }
        Ok(r as i32)
    }

    /// Every member's (shape, dtype).
    fn headers(&self, t: &Tensor) -> Result<Vec<(Vec<usize>, DType)>> {
        let mine = header(t)?;
        let mut all = vec![0u64; HEADER * self.size];
        self.comm().all_gather_into(&mine[..], &mut all[..]);
        all.chunks(HEADER).map(parse_header).collect()
    }

    fn agree(&self, op: &str, t: &Tensor, reference: usize) -> Result<()> {
        check_agree(op, &self.headers(t)?, reference).map_err(Error::Comm)
    }

    /// Member `r` gets elements `shares[r]` of every member's flat `t`, in rank order:
    /// `MPI_Alltoallv` moves the bytes and adds nothing.
    fn exchange(&self, flat: &Tensor, shares: &[Range<usize>]) -> Result<Vec<Tensor>> {
        let (dt, size) = (flat.dtype(), self.size);
        let bytes = |n: usize| count_i32(n * dt.size_in_bytes());
        let counts = |f: &dyn Fn(usize) -> usize| -> Result<Vec<i32>> {
            (0..size).map(|r| bytes(f(r))).collect()
        };
        let (send_counts, send_displs) =
            (counts(&|r| shares[r].len())?, counts(&|r| shares[r].start)?);
        let mine = shares[self.rank].len();
        let (recv_counts, recv_displs) = (counts(&|_| mine)?, counts(&|r| r * mine)?);
        let mut buf = Buf::for_receive(dt, mine * size)?;
        with_bytes(flat, |b| {
            let send = Partition::new(b, &send_counts[..], &send_displs[..]);
            let mut recv = PartitionMut::new(buf.bytes_mut(), &recv_counts[..], &recv_displs[..]);
            match self.polite {
                true => mpi::request::scope(|sc| {
                    settle(
                        self.comm()
                            .immediate_all_to_all_varcount_into(sc, &send, &mut recv),
                    )
                }),
                false => self.comm().all_to_all_varcount_into(&send, &mut recv),
            }
        })?;
        let all = buf.into_tensor(&[size, mine])?;
        (0..size).map(|r| Ok(all.get(r)?)).collect()
    }

    /// Every member's `part` (flat, lengths `lens`), joined in rank order.
    fn gather_flat(&self, part: &Tensor, lens: &[usize]) -> Result<Tensor> {
        let dt = part.dtype();
        let bytes = |n: usize| count_i32(n * dt.size_in_bytes());
        let counts: Vec<i32> = lens.iter().map(|n| bytes(*n)).collect::<Result<_>>()?;
        let displs: Vec<i32> = (0..lens.len())
            .map(|r| bytes(lens[..r].iter().sum()))
            .collect::<Result<_>>()?;
        let mut buf = Buf::for_receive(dt, lens.iter().sum())?;
        with_bytes(part, |mine| {
            let mut all = PartitionMut::new(buf.bytes_mut(), &counts[..], &displs[..]);
            match self.polite {
                true => mpi::request::scope(|sc| {
                    settle(
                        self.comm()
                            .immediate_all_gather_varcount_into(sc, mine, &mut all),
                    )
                }),
                false => self.comm().all_gather_varcount_into(mine, &mut all),
            }
        })?;
        buf.into_tensor(&[lens.iter().sum()])
    }

    /// all_reduce (or reduce_scatter) in rank order ([`ordered`]): each member reduces its share
    /// of the elements (its rows), and all_reduce gathers the shares.
    fn reduce(&self, t: &Tensor, op: ReduceOp, scatter: bool) -> Result<Tensor> {
        let name = if scatter {
            "reduce_scatter"
        } else {
            "all_reduce"
        };
        self.agree(name, t, 0)?;
        let dims = reduce_plan(t, op, self.size, scatter)?;
        let flat = t.flatten_all()?;
        let n = flat.elem_count();
        let shares: Vec<Range<usize>> = (0..self.size)
            .map(|r| match scatter {
                true => r * n / self.size..(r + 1) * n / self.size,
                false => ordered::share(n, self.size, r),
            })
            .collect();
        let mine = ordered::combine(&self.exchange(&flat, &shares)?, op)?;
        if scatter {
            return Ok(mine.reshape(dims)?);
        }
        let lens: Vec<usize> = shares.iter().map(|r| r.len()).collect();
        Ok(self.gather_flat(&mine, &lens)?.reshape(dims)?)
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn send(&self, t: &Tensor, dst: usize, tag: u64) -> Result<()> {
        let t = &to_host(t, "mpi")?;
        let p = self
            .comm()
            .process_at_rank(self.peer(dst, "send", Some(tag))?);
        let h = header(t)?;
        p.send_with_tag(&h[..], tag as i32);
        with_bytes(t, |b| p.send_with_tag(b, tag as i32))
    }

    fn recv(&self, src: usize, tag: u64) -> Result<Tensor> {
        let p = self
            .comm()
            .process_at_rank(self.peer(src, "recv", Some(tag))?);
        let mut h = [0u64; HEADER];
        p.receive_into_with_tag(&mut h[..], tag as i32);
        let (dims, dt) = parse_header(&h)?;
        let (n, c, s, t) = (dims.iter().product(), self.comm(), src as i32, tag as i32);
        let buf = match dt {
            DType::U8 => Buf::U8(recv_new(c, n, s, t)?),
            DType::U32 => Buf::U32(recv_new(c, n, s, t)?),
            DType::I64 => Buf::I64(recv_new(c, n, s, t)?),
            DType::BF16 => Buf::BF16(recv_new(c, n, s, t)?),
            DType::F16 => Buf::F16(recv_new(c, n, s, t)?),
            DType::F32 => Buf::F32(recv_new(c, n, s, t)?),
            DType::F64 => Buf::F64(recv_new(c, n, s, t)?),
            other => {
                return Err(Error::Comm(format!(
                    "the MPI backend does not carry {other:?} tensors"
                )))
            }
        };
        buf.into_tensor(&dims)
    }

    fn isend(&self, t: &Tensor, dst: usize, tag: u64) -> Result<Pending<()>> {
        self.peer(dst, "isend", Some(tag))?;
        let me = self.alias();
        let t = t.clone();
        let h = std::thread::spawn(move || me.send(&t, dst, tag));
        Ok(Pending::new(move || {
            h.join()
                .map_err(|_| Error::Comm("isend thread panicked".into()))?
        }))
    }

    fn irecv(&self, src: usize, tag: u64) -> Result<Pending<Tensor>> {
        self.peer(src, "irecv", Some(tag))?;
        let me = self.alias();
        let h = std::thread::spawn(move || me.recv(src, tag));
        Ok(Pending::new(move || {
            h.join()
                .map_err(|_| Error::Comm("irecv thread panicked".into()))?
        }))
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        Ok(self
            .reduce(&to_host(t, "mpi")?, op, false)?
            .to_device(t.device())?)
    }

    fn iall_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Pending<Tensor>> {
        self.on_progress(t, |p, t| p.all_reduce(t, op))
    }

    fn ireduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Pending<Tensor>> {
        self.on_progress(t, |p, t| p.reduce_scatter(t, op))
    }

    fn iall_gather(&self, t: &Tensor) -> Result<Pending<Vec<Tensor>>> {
        let (here, t) = (t.device().clone(), to_host(t, "mpi")?);
        let h = self.progress()?.all_gather(&t)?;
        Ok(Pending::new(move || {
            let parts = h.wait()?;
            Ok(parts
                .iter()
                .map(|p| p.to_device(&here))
                .collect::<candle_core::Result<_>>()?)
        }))
    }

    fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        let (here, t) = (t.device(), &to_host(t, "mpi")?);
        let parts = self.headers(t)?;
        check_same_dtype(&parts).map_err(Error::Comm)?;
        let esize = t.dtype().size_in_bytes();
        let counts: Vec<i32> = parts
            .iter()
            .map(|(d, _)| (d.iter().product::<usize>() * esize) as i32)
            .collect();
        let displs: Vec<i32> = counts
            .iter()
            .scan(0, |acc, c| Some(std::mem::replace(acc, *acc + c)))
            .collect();
        let total: usize = counts.iter().map(|c| *c as usize).sum();
        let mut all = vec![0u8; total];
        with_bytes(t, |mine| {
            let mut part = PartitionMut::new(&mut all[..], &counts[..], &displs[..]);
            self.comm().all_gather_varcount_into(mine, &mut part);
        })?;
        parts
            .iter()
            .zip(displs.iter().zip(&counts))
            .map(|((dims, dt), (&off, &len))| {
                Ok(
                    tensor_from_bytes(*dt, dims, &all[off as usize..(off + len) as usize])?
                        .to_device(here)?,
                )
            })
            .collect()
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        Ok(self
            .reduce(&to_host(t, "mpi")?, op, true)?
            .to_device(t.device())?)
    }

    /// `MPI_Alltoallv` of each part's bytes, after the plan's descriptors.
    fn all_to_all(&self, parts: &[Tensor]) -> Result<Vec<Tensor>> {
        let plan = all_to_all::agree(self, parts)?;
        let here = parts[0].device();
        let joined = to_host(&Tensor::cat(parts, 0)?, "mpi")?;
        let row = plan.row.iter().product::<usize>();
        let layout = |rows: &[usize]| -> Result<(Vec<i32>, Vec<i32>)> {
            let bytes = |r: usize| count_i32(r * row * plan.dtype.size_in_bytes());
            let counts = rows.iter().map(|r| bytes(*r)).collect::<Result<_>>()?;
            let displs = (0..rows.len())
                .map(|i| bytes(rows[..i].iter().sum()))
                .collect::<Result<_>>()?;
            Ok((counts, displs))
        };
        let (sent, got) = (&plan.rows[self.rank], plan.received(self.rank));
        let ((sc, sd), (rc, rd)) = (layout(sent)?, layout(&got)?);
        let total: usize = got.iter().sum();
        let mut buf = Buf::for_receive(plan.dtype, total * row)?;
        with_bytes(&joined, |b| {
            let send = Partition::new(b, &sc[..], &sd[..]);
            let mut recv = PartitionMut::new(buf.bytes_mut(), &rc[..], &rd[..]);
            self.comm().all_to_all_varcount_into(&send, &mut recv);
        })?;
        let all = buf.into_tensor(&plan.dims(total))?;
        let starts = got
            .iter()
            .scan(0, |at, r| Some(std::mem::replace(at, *at + r)));
        starts
            .zip(&got)
            .map(|(start, rows)| Ok(all.narrow(0, start, *rows)?.to_device(here)?))
            .collect()
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let r = self.peer(root, "broadcast", None)?;
        self.agree("broadcast", t, root)?;
        let mut buf = Buf::for_receive(t.dtype(), t.elem_count())?;
        if self.rank == root {
            with_bytes(&to_host(t, "mpi")?, |b| buf.bytes_mut().copy_from_slice(b))?;
        }
        self.comm()
            .process_at_rank(r)
            .broadcast_into(buf.bytes_mut());
        Ok(buf.into_tensor(t.dims())?.to_device(t.device())?)
    }

    fn barrier(&self) -> Result<()> {
        self.comm().barrier();
        Ok(())
    }

    fn split(&self, members: &[usize]) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.split_mpi(members)?))
    }
}
