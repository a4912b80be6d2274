//! A communicator's speed measured (`pipewright bench comm`): send/recv as a ping-pong
//! between ranks 0 and 1 and all-reduce over every rank, at each buffer size, in rounds that
//! alternate the operations (each row the median round); under MPI beside the same operations
//! as raw MPI calls; and the [`Link`] the planner reads, fitted to them.

use std::time::Instant;

use candle_core::{Device, Tensor};

use super::hardware::Link;
use super::layer_cost::median;
use crate::distributed::comm::{Communicator, ReduceOp};
use crate::{invalid, Result};

/// One measured row: seconds per operation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Row {
    /// The buffer's size in MiB of f32.
    pub mib: f64,
    /// `send/recv` or `all_reduce`.
    pub op: &'static str,
    /// Seconds per operation (a one-way transfer for send/recv).
    pub secs: f64,
}

impl Row {
    /// Its bandwidth in GB/s.
    pub fn gbps(&self) -> f64 {
        (elements(self.mib) * 4) as f64 / self.secs / 1e9
    }
}

/// f32 elements of a buffer of `mib` MiB (at least one).
fn elements(mib: f64) -> usize {
    ((mib * 1024.0 * 1024.0 / 4.0).round() as usize).max(1)
}

/// Rounds of alternating measurements; each row reports the median round.
const ROUNDS: usize = 5;

/// Seconds per operation of `f` over `iters` calls, after one warm-up call and a barrier.
fn time(
    iters: usize,
    per_call: usize,
    sync: &dyn Fn() -> Result<()>,
    f: &mut dyn FnMut() -> Result<()>,
) -> Result<f64> {
    f()?;
    sync()?;
    let s = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    Ok(s.elapsed().as_secs_f64() / (per_call * iters) as f64)
}

/// The operations of one buffer size: send/recv as a ping-pong between ranks 0 and 1 (two
/// one-way transfers per call) and all-reduce.
struct Ops<'a> {
    comm: &'a dyn Communicator,
    t: Tensor,
}

impl Ops<'_> {
    fn new(comm: &dyn Communicator, mib: f64) -> Result<Ops<'_>> {
        let n = elements(mib);
        Ok(Ops {
            comm,
            t: Tensor::ones(n, candle_core::DType::F32, &Device::Cpu)?,
        })
    }

    fn pingpong(&self) -> Result<()> {
        match self.comm.rank() {
            0 => {
                self.comm.send(&self.t, 1, 1)?;
                self.comm.recv(1, 2)?;
            }
            1 => {
                let back = self.comm.recv(0, 1)?;
                self.comm.send(&back, 0, 2)?;
            }
            _ => {}
        }
        Ok(())
    }

    fn all_reduce(&self) -> Result<()> {
        self.comm.all_reduce(&self.t, ReduceOp::Sum).map(|_| ())
    }
}

/// Times send/recv and all-reduce through `comm` at each of `sizes` (MiB), `iters` calls a
/// round (every rank calls it).
pub fn measure(comm: &dyn Communicator, sizes: &[f64], iters: usize) -> Result<Vec<Row>> {
    if comm.size() < 2 {
        return Err(invalid!("the communication bench needs at least 2 ranks"));
    }
    let sync = || comm.barrier();
    let mut rows = Vec::new();
    for &mib in sizes {
        let ops = Ops::new(comm, mib)?;
        let mut p = Vec::new();
        let mut a = Vec::new();
        for _ in 0..ROUNDS {
            p.push(time(iters, 2, &sync, &mut || ops.pingpong())?);
            a.push(time(iters, 1, &sync, &mut || ops.all_reduce())?);
        }
        rows.push(Row {
            mib,
            op: "send/recv",
            secs: median(p),
        });
        rows.push(Row {
            mib,
            op: "all_reduce",
            secs: median(a),
        });
    }
    Ok(rows)
}

/// The link fitted to `rows` (at least two sizes) measured over `world` ranks: latency and
/// bandwidth of send/recv and of all-reduce, for the planner (`pipewright plan --link`).
pub fn fit_link(rows: &[Row], world: usize) -> Result<Link> {
    let points = |op: &str| -> Vec<(f64, f64)> {
        rows.iter()
            .filter(|r| r.op == op)
            .map(|r| ((elements(r.mib) * 4) as f64, r.secs))
            .collect()
    };
    let (p2p, all_reduce) = (points("send/recv"), points("all_reduce"));
    if p2p.len() < 2 {
        return Err(invalid!(
            "fitting latency and bandwidth takes at least two sizes, a small and a large"
        ));
    }
    Ok(Link::fit(&p2p, &all_reduce, world))
}

/// [`measure`] through the MPI communicator `world`, alternated round by round with the same
/// operations as raw MPI calls on plain buffers so that both see the same machine: pipewright's
/// rows and raw MPI's (every rank calls it).
#[cfg(feature = "mpi")]
pub fn measure_beside_mpi(
    world: &crate::distributed::comm::mpi::MpiComm,
    sizes: &[f64],
    iters: usize,
) -> Result<(Vec<Row>, Vec<Row>)> {
    use mpi::traits::{Communicator as _, CommunicatorCollectives, Destination, Source};

    if world.size() < 2 {
        return Err(invalid!(
            "the communication bench needs at least 2 ranks: mpirun -np 2"
        ));
    }
    // The same operations as raw MPI calls on plain buffers, alternated round by round with
    // pipewright's so both see the same machine.
    let raw_comm = mpi::topology::SimpleCommunicator::world();
    let rank = world.rank();
    let sync = || world.barrier();
    let (mut ours, mut raw) = (Vec::new(), Vec::new());
    for &mib in sizes {
        let ops = Ops::new(world, mib)?;
        let n = elements(mib);
        let send = vec![1f32; n];
        let mut recv = vec![0f32; n];
        let mut raw_pingpong = || -> Result<()> {
            match rank {
                0 => {
                    raw_comm.process_at_rank(1).send_with_tag(&send[..], 1);
                    raw_comm
                        .process_at_rank(1)
                        .receive_into_with_tag(&mut recv[..], 2);
                }
                1 => {
                    raw_comm
                        .process_at_rank(0)
                        .receive_into_with_tag(&mut recv[..], 1);
                    raw_comm.process_at_rank(0).send_with_tag(&recv[..], 2);
                }
                _ => {}
            }
            Ok(())
        };
        let mut t = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        for _ in 0..ROUNDS {
            t[0].push(time(iters, 2, &sync, &mut || ops.pingpong())?);
            t[1].push(time(iters, 2, &sync, &mut raw_pingpong)?);
        }
        let op = mpi::collective::SystemOperation::sum();
        let mut out = vec![0f32; n];
        for _ in 0..ROUNDS {
            t[2].push(time(iters, 1, &sync, &mut || ops.all_reduce())?);
            t[3].push(time(iters, 1, &sync, &mut || {
                raw_comm.all_reduce_into(&send[..], &mut out[..], op);
                Ok(())
            })?);
        }
        let [p, rp, ar, rar] = t;
        ours.push(Row {
            mib,
            op: "send/recv",
            secs: median(p),
        });
        raw.push(Row {
            mib,
            op: "send/recv",
            secs: median(rp),
        });
        ours.push(Row {
            mib,
            op: "all_reduce",
            secs: median(ar),
        });
        raw.push(Row {
            mib,
            op: "all_reduce",
            secs: median(rar),
        });
    }
    Ok((ours, raw))
}
