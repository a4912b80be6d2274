//! `pipewright bench comm`: bandwidth of send/recv and all-reduce through a communicator, and,
//! for MPI, of the same operations as raw MPI calls in the same run
//! ([`pipewright::plan::comm_bench`]).

use clap::{Args, Subcommand};
use pipewright::distributed::comm::Backend;
use pipewright::plan::comm_bench::{fit_link, measure, Row};
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

fn print(backend: &str, world: usize, rows: &[Row], raw: Option<&[Row]>) {
    pipewright::say!("pipewright bench comm: backend {backend}, {world} ranks, f32 buffers");
    match raw {
        None => {
            pipewright::say!("{:>12}  {:<11} {:>12}", "size", "op", "GB/s");
            for r in rows {
                pipewright::say!("{:>8} MiB  {:<11} {:>12.2}", r.mib, r.op, r.gbps());
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
                let (a, b) = (r.gbps(), m.gbps());
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
    pipewright::runtime::memory::check_fits(
        most * (1u64 << 20) as f64 * 3.0 * ranks_here as f64,
        &format!("bench comm of {most} MiB buffers on {ranks_here} ranks here"),
        "give smaller --sizes (MiB) or a smaller --world",
    )?;
    if let Some(out) = &a.out {
        pipewright::runtime::files::ensure_replaceable(out, "--out", "a fitted link", |t| {
            serde_json::from_str::<pipewright::plan::Link>(t).is_ok()
        })?;
    }
    match a.backend {
        Backend::Local => {
            let (sizes, iters) = (a.sizes.clone(), a.iters);
            let mut out =
                pipewright::distributed::comm::local::run(a.world, |c| measure(&c, &sizes, iters))?;
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
    let link = fit_link(rows, world)?;
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
    use pipewright::distributed::comm::Communicator;
    let (_mpi, world) = pipewright::distributed::comm::mpi::Mpi::init()?;
    let (ours, raw) = pipewright::plan::comm_bench::measure_beside_mpi(&world, &a.sizes, a.iters)?;
    if world.is_master() {
        print("mpi", world.size(), &ours, Some(&raw));
        write_link(a, &ours, world.size())?;
    }
    Ok(())
}
