//! `pipewright bench comm`: bandwidth of send/recv and all-reduce through a
//! [`Communicator`], and, for MPI, of the same operations as raw MPI calls in the same run.

use std::time::Instant;

use clap::{Args, Subcommand};
use pipewright::candle_core::{Device, Tensor};
use pipewright::comm::{Backend, Communicator, ReduceOp};
use pipewright::plan::median;
use pipewright::{invalid, Result};

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Send/recv (ping-pong between ranks 0 and 1) and all-reduce bandwidth in GB/s.
    Comm(CommArgs),
    /// Checkpoint save and load GB/s beside plain file I/O, and the stall of an async save.
    Ckpt(crate::bench_ckpt::CkptBenchArgs),
}

#[derive(Args)]
pub struct CommArgs {
    /// How the ranks talk: local (threads of this process) or mpi (one process per rank under
    /// `mpirun -np N`; build with `--features mpi`).
    #[arg(long, default_value = "local")]
    pub backend: Backend,
    /// Ranks of the local backend.
    #[arg(long, default_value_t = 2)]
    pub world: usize,
    /// Buffer sizes in MiB of f32 (fractions too: 0.01 is about 10 KB).
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    pub sizes: Vec<f64>,
    /// Timed repetitions per round (after one warm-up); rows report the median of 5 rounds.
    #[arg(long, default_value_t = 10)]
    pub iters: usize,
    /// Write the link fitted to pipewright's timings (latency + bytes / bandwidth, for
    /// send/recv and for all-reduce at this world size) to this JSON file, for
    /// `pipewright plan --link` (use a small and a large size).
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
}

/// One measured row: seconds per operation.
pub struct Row {
    pub mib: f64,
    pub op: &'static str,
    pub secs: f64,
}

/// f32 elements of a buffer of `mib` MiB (at least one).
fn elements(mib: f64) -> usize {
    ((mib * 1024.0 * 1024.0 / 4.0).round() as usize).max(1)
}

fn gbps(mib: f64, secs: f64) -> f64 {
    (elements(mib) * 4) as f64 / secs / 1e9
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
            t: Tensor::ones(n, pipewright::candle_core::DType::F32, &Device::Cpu)?,
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

/// Times send/recv and all-reduce through `comm` (every rank calls it).
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

fn print(backend: &str, world: usize, rows: &[Row], raw: Option<&[Row]>) {
    pipewright::say!("pipewright bench comm: backend {backend}, {world} ranks, f32 buffers");
    match raw {
        None => {
            pipewright::say!("{:>12}  {:<11} {:>12}", "size", "op", "GB/s");
            for r in rows {
                pipewright::say!(
                    "{:>8} MiB  {:<11} {:>12.2}",
                    r.mib,
                    r.op,
                    gbps(r.mib, r.secs)
                );
            }
        }
        Some(raw) => {
            pipewright::say!(
                "{:>12}  {:<11} {:>16} {:>13} {:>7}",
                "size",
                "op",
                "pipewright GB/s",
                "raw MPI GB/s",
                "ratio"
            );
            for (r, m) in rows.iter().zip(raw) {
                let (a, b) = (gbps(r.mib, r.secs), gbps(m.mib, m.secs));
                pipewright::say!(
                    "{:>8} MiB  {:<11} {:>16.2} {:>13.2} {:>7.2}",
                    r.mib,
                    r.op,
                    a,
                    b,
                    a / b
                );
            }
        }
    }
}

pub fn run(cmd: BenchCommand) -> Result<()> {
    let a = match cmd {
        BenchCommand::Comm(a) => a,
        BenchCommand::Ckpt(a) => return crate::bench_ckpt::run(a),
    };
    if a.iters == 0 || a.sizes.is_empty() || a.sizes.iter().any(|s| s.is_nan() || *s <= 0.0) {
        return Err(invalid!("--iters and every --sizes entry must be positive"));
    }
    // Each rank holds its buffer, the result and the received parts (three of the largest),
    // and as threads, the ranks share this process.
    let ranks_here = if a.backend == Backend::Local {
        a.world
    } else {
        1
    };
    let most = a.sizes.iter().copied().fold(0.0, f64::max);
    pipewright::memory::check_fits(
        most * (1u64 << 20) as f64 * 3.0 * ranks_here as f64,
        &format!("bench comm of {most} MiB buffers on {ranks_here} ranks here"),
        "give smaller --sizes (MiB) or a smaller --world",
    )?;
    if let Some(out) = &a.out {
        pipewright::files::ensure_replaceable(out, "--out", "a fitted link", |t| {
            serde_json::from_str::<pipewright::plan::Link>(t).is_ok()
        })?;
    }
    match a.backend {
        Backend::Local => {
            let (sizes, iters) = (a.sizes.clone(), a.iters);
            let mut out = pipewright::comm::local::run(a.world, |c| measure(&c, &sizes, iters))?;
            let rows = out.swap_remove(0);
            print("local", a.world, &rows, None);
            write_link(&a, &rows, a.world)
        }
        Backend::Mpi => mpi_bench(&a),
        Backend::Nccl => Err(invalid!(
            "bench comm measures the local and mpi backends: use --backend local or mpi"
        )),
    }
}

/// Writes the link fitted to `rows` to `--out`, if given.
fn write_link(a: &CommArgs, rows: &[Row], world: usize) -> Result<()> {
    let Some(path) = &a.out else {
        return Ok(());
    };
    if a.sizes.len() < 2 {
        return Err(invalid!(
            "--out fits latency and bandwidth: give at least two --sizes, a small and a large"
        ));
    }
    let points = |op: &str| -> Vec<(f64, f64)> {
        rows.iter()
            .filter(|r| r.op == op)
            .map(|r| ((elements(r.mib) * 4) as f64, r.secs))
            .collect()
    };
    let link = pipewright::plan::Link::fit(&points("send/recv"), &points("all_reduce"), world);
    let text = serde_json::to_string_pretty(&link).map_err(|e| invalid!("{e}"))?;
    std::fs::write(path, text).map_err(|e| pipewright::Error::io("cannot write", path, e))?;
    pipewright::say!(
        "wrote {}: send/recv {:.1} us + bytes / {:.2} GB/s",
        path.display(),
        link.latency_s * 1e6,
        link.bandwidth_bytes_per_s / 1e9
    );
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn mpi_bench(_: &CommArgs) -> Result<()> {
    Err(invalid!(
        "this pipewright was built without MPI: build with `--features mpi` (tools/install-mpi.sh \
         installs Open MPI) and run under `mpirun -np 2`"
    ))
}

#[cfg(feature = "mpi")]
fn mpi_bench(a: &CommArgs) -> Result<()> {
    use mpi::traits::{Communicator as _, CommunicatorCollectives, Destination, Source};
    use pipewright::comm::mpi::Mpi;

    let (_mpi, world) = Mpi::init()?;
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
    for &mib in &a.sizes {
        let ops = Ops::new(&world, mib)?;
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
            t[0].push(time(a.iters, 2, &sync, &mut || ops.pingpong())?);
            t[1].push(time(a.iters, 2, &sync, &mut raw_pingpong)?);
        }
        let op = mpi::collective::SystemOperation::sum();
        let mut out = vec![0f32; n];
        for _ in 0..ROUNDS {
            t[2].push(time(a.iters, 1, &sync, &mut || ops.all_reduce())?);
            t[3].push(time(a.iters, 1, &sync, &mut || {
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
    if world.is_master() {
        print("mpi", world.size(), &ours, Some(&raw));
        write_link(a, &ours, world.size())?;
    }
    Ok(())
}
