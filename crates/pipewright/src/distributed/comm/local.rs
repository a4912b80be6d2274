//! Ranks as threads of one process, exchanging tensors through shared mailboxes: no
//! serialisation, a tensor moves as a reference to its storage (a parameter is copied first,
//! since the sender may update it in place).
//!
//! [`run`] spawns the ranks and joins them. A rank that returns an error or panics marks the
//! world as failed: every pending or later call of every other rank returns an error naming
//! that rank, so nothing hangs. A receive that waits longer than the timeout (default 300 s,
//! `PIPEWRIGHT_COMM_TIMEOUT` seconds, or [`run_with_timeout`]) is an error naming both ranks.
//!
//! A receive polls its mailbox for a while before it sleeps, when the world's ranks fit the
//! machine's cores (as MPI and NCCL poll): waking a sleeping thread took long enough here to
//! slow two-rank steps by 7-13 % (pp 2, dp 2, tp 2 on two cores, 50 us of polling). With more
//! ranks than cores a poller takes the core a rank would compute on (4 ranks on 2 cores: up to
//! twice as slow with 200 us), so it sleeps at once. `PIPEWRIGHT_COMM_SPIN_US` sets the time.
//!
//! Collectives gather at the group's first member, which checks the tensors and hands every
//! member all of them; each member reduces them in rank order ([`super::ordered`]), so
//! reductions are bit-identical on every member and to every other backend's.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use candle_core::Tensor;

use super::all_to_all::{descriptor, Plan};
use super::{
    check_agree, check_same_dtype, describe, ordered, Communicator, Pending, ReduceOp, MAX_TAG,
};
use crate::runtime::seed::hash_seed;
use crate::{Error, Result};

mod collective;
mod spawn;
mod world;
use spawn::default_timeout;
pub use spawn::{run, run_with_timeout};
use world::{Msg, State, World};

/// One rank's view of a group of threads.
pub struct LocalComm {
    world: Arc<World>,
    group: u64,
    /// World ranks of the members, indexed by group rank.
    members: Arc<Vec<usize>>,
    rank: usize,
    seq: AtomicU64,
}

fn check_same(op: &str, ts: &[Tensor], reference: usize) -> std::result::Result<(), String> {
    let parts: Vec<_> = ts.iter().map(|t| (t.dims().to_vec(), t.dtype())).collect();
    check_agree(op, &parts, reference)
}

/// Whether tensors of `t`'s dtype can be reduced by `op` (an error for every rank if not).
fn reducible(t: &Tensor, op: ReduceOp) -> std::result::Result<(), String> {
    if op == ReduceOp::Avg && t.dtype().is_int() {
        return Err(format!(
            "cannot average {:?} tensors: use ReduceOp::Sum and divide where the rounding is known",
            t.dtype()
        ));
    }
    Ok(())
}

impl LocalComm {
    fn world_rank(&self, r: usize, what: &str) -> Result<usize> {
        self.members.get(r).copied().ok_or_else(|| {
            Error::Comm(format!(
                "rank {}: {what} names rank {r}, outside this group of {} ranks",
                self.rank,
                self.members.len()
            ))
        })
    }

    fn me(&self) -> usize {
        self.members[self.rank]
    }

    fn check_tag(&self, tag: u64) -> Result<()> {
        if tag >= MAX_TAG {
            return Err(Error::Comm(format!(
                "tag {tag} is too large: use tags below {MAX_TAG}"
            )));
        }
        Ok(())
    }

    /// A tensor safe to hand to another thread: detached from this rank's graph, and copied if
    /// it is a parameter (which this rank may update in place later).
    fn outgoing(t: &Tensor) -> Result<Tensor> {
        Ok(if t.is_variable() {
            t.copy()?.detach()
        } else {
            t.detach()
        })
    }

    /// Runs one collective: every member's `inputs` go to member 0, which turns them into one
    /// reply per member (or an error for all); each member gets its reply on the device of its
    /// inputs (threads may sit on different GPUs).
    fn collective(
        &self,
        name: &'static str,
        inputs: Vec<Tensor>,
        combine: impl FnOnce(Vec<Vec<Tensor>>) -> std::result::Result<Vec<Vec<Tensor>>, String>,
    ) -> Result<Vec<Tensor>> {
        self.start(name, inputs)?.finish(combine)
    }
}

/// `t`, received from another rank, as memory of the receiving rank: a copy, made (and
/// counted, [`crate::runtime::memory`]) in its thread, as a rank of another process would receive into
/// its own buffer. Sharing the sender's tensor charged it to the sender for as long as the
/// receiver held it, so a rank's measured peak moved with its partners' timing.
fn own(t: Tensor) -> Result<Tensor> {
    Ok(t.copy()?)
}

fn first(ts: Vec<Vec<Tensor>>) -> Vec<Tensor> {
    ts.into_iter().map(|mut v| v.remove(0)).collect()
}

/// Member `rank`'s part of the reduce-scatter `started` (of `n` members): the collective
/// checks the inputs, then each member reduces its own part only.
fn reduce_own_part(
    started: collective::Started,
    n: usize,
    rank: usize,
    op: ReduceOp,
) -> Result<Tensor> {
    let all = started.finish(|all| {
        let ts = first(all);
        check_same("reduce_scatter", &ts, 0)?;
        let rows =
            ts[0].dims().first().copied().ok_or_else(|| {
                "reduce_scatter: a 0-d tensor has no dim 0 to scatter".to_string()
            })?;
        if rows % n != 0 {
            return Err(format!(
                "reduce_scatter: dim 0 of {} does not split into {n} equal parts",
                describe(&ts[0])
            ));
        }
        reducible(&ts[0], op).map_err(|e| format!("reduce_scatter: {e}"))?;
        Ok(vec![ts; n])
    })?;
    let part = all[0].dim(0)? / n;
    let mine = all
        .iter()
        .map(|t| t.narrow(0, rank * part, part))
        .collect::<candle_core::Result<Vec<_>>>()?;
    ordered::combine(&mine, op)?
        .contiguous()
        .map_err(Into::into)
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn backend(&self) -> &'static str {
        "local"
    }

    fn send(&self, t: &Tensor, dst: usize, tag: u64) -> Result<()> {
        self.check_tag(tag)?;
        let d = self.world_rank(dst, "send")?;
        self.world.post(
            (self.group, self.me(), d, tag),
            Msg::Tensors(vec![Self::outgoing(t)?]),
        );
        Ok(())
    }

    fn recv(&self, src: usize, tag: u64) -> Result<Tensor> {
        self.check_tag(tag)?;
        let s = self.world_rank(src, "recv")?;
        let mut v = self
            .world
            .take((self.group, s, self.me(), tag), self.me(), "recv")?;
        own(v.remove(0))
    }

    fn isend(&self, t: &Tensor, dst: usize, tag: u64) -> Result<Pending<()>> {
        self.send(t, dst, tag)?;
        Ok(Pending::new(|| Ok(())))
    }

    fn irecv(&self, src: usize, tag: u64) -> Result<Pending<Tensor>> {
        self.check_tag(tag)?;
        let s = self.world_rank(src, "irecv")?;
        let (world, key, me) = (
            self.world.clone(),
            (self.group, s, self.me(), tag),
            self.me(),
        );
        Ok(Pending::new(move || {
            own(world.take(key, me, "irecv")?.remove(0))
        }))
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.iall_reduce(t, op)?.wait()
    }

    fn iall_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Pending<Tensor>> {
        let n = self.size();
        let started = self.start("all_reduce", vec![t.clone()])?;
        Ok(Pending::new(move || {
            let all = started.finish(|all| {
                let ts = first(all);
                check_same("all_reduce", &ts, 0)?;
                reducible(&ts[0], op).map_err(|e| format!("all_reduce: {e}"))?;
                Ok(vec![ts; n])
            })?;
            // Each rank reduces into memory of its own (counted to it, as a rank of another
            // process would hold its own result), the same bits on every rank.
            ordered::combine(&all, op)
        }))
    }

    fn all_gather(&self, t: &Tensor) -> Result<Vec<Tensor>> {
        self.iall_gather(t)?.wait()
    }

    fn iall_gather(&self, t: &Tensor) -> Result<Pending<Vec<Tensor>>> {
        let (n, mine) = (self.size(), self.rank);
        let started = self.start("all_gather", vec![t.clone()])?;
        Ok(Pending::new(move || {
            let all = started.finish(|all| {
                let ts = first(all);
                let parts: Vec<_> = ts.iter().map(|t| (t.dims().to_vec(), t.dtype())).collect();
                check_same_dtype(&parts)?;
                Ok(vec![ts; n])
            })?;
            // Its own part is its input; the others', copies of its own.
            all.into_iter()
                .enumerate()
                .map(|(r, t)| if r == mine { Ok(t) } else { own(t) })
                .collect()
        }))
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.ireduce_scatter(t, op)?.wait()
    }

    fn ireduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Pending<Tensor>> {
        let (n, rank) = (self.size(), self.rank);
        let started = self.start("reduce_scatter", vec![t.clone()])?;
        Ok(Pending::new(move || reduce_own_part(started, n, rank, op)))
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let n = self.size();
        self.world_rank(root, "broadcast")?;
        let mut r = self.collective("broadcast", vec![t.clone()], |all| {
            let ts = first(all);
            check_same("broadcast", &ts, root)?;
            Ok(vec![vec![ts[root].clone()]; n])
        })?;
        match self.rank == root {
            true => Ok(r.remove(0)),
            false => own(r.remove(0)),
        }
    }

    fn all_to_all(&self, parts: &[Tensor]) -> Result<Vec<Tensor>> {
        let n = self.size();
        let got = self.collective("all_to_all", parts.to_vec(), |all| {
            let descriptors: Vec<_> = all.iter().map(|p| descriptor(p)).collect();
            Plan::agree(&descriptors)?;
            Ok((0..n)
                .map(|dst| all.iter().map(|p| p[dst].clone()).collect())
                .collect())
        })?;
        // Its own part is its input; the others', copies of their own.
        let mine = self.rank;
        got.into_iter()
            .enumerate()
            .map(|(r, t)| if r == mine { Ok(t) } else { own(t) })
            .collect()
    }

    fn barrier(&self) -> Result<()> {
        let n = self.size();
        self.collective("barrier", Vec::new(), |_| Ok(vec![Vec::new(); n]))?;
        Ok(())
    }

    fn split(&self, members: &[usize]) -> Result<Box<dyn Communicator>> {
        let mut seen = vec![false; self.size()];
        for &m in members {
            if m >= self.size() || std::mem::replace(&mut seen[m], true) {
                return Err(Error::Comm(format!(
                    "split: members {members:?} must be distinct ranks below {}",
                    self.size()
                )));
            }
        }
        let rank = members
            .iter()
            .position(|&m| m == self.rank)
            .ok_or_else(|| {
                Error::Comm(format!(
                    "split: rank {} is not among the members {members:?}",
                    self.rank
                ))
            })?;
        let world: Vec<usize> = members.iter().map(|&m| self.members[m]).collect();
        let bytes: Vec<u8> = world
            .iter()
            .flat_map(|r| (*r as u64).to_le_bytes())
            .collect();
        let group = hash_seed(&[&self.group.to_le_bytes(), &bytes]);
        Ok(Box::new(LocalComm {
            world: self.world.clone(),
            group,
            members: Arc::new(world),
            rank,
            seq: AtomicU64::new(0),
        }))
    }
}

impl LocalComm {
    /// A world of one rank: this thread alone (what a program started by nothing gets).
    pub fn single() -> Self {
        LocalComm {
            world: Arc::new(World {
                size: 1,
                state: Mutex::new(State::default()),
                cvs: vec![Condvar::new()],
                timeout: default_timeout(),
                spin: Duration::ZERO,
            }),
            group: 0,
            members: Arc::new(vec![0]),
            rank: 0,
            seq: AtomicU64::new(0),
        }
    }

    /// Number of ranks in the whole process world.
    pub fn world_size(&self) -> usize {
        self.world.size
    }
}
