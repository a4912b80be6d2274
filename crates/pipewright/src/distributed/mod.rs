//! Who this process is, from whatever started it (pystematic's and torchrun's launch
//! parameters): `pipewright launch` and torchrun (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
//! `LOCAL_WORLD_SIZE`, `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`), Open MPI's `mpirun`
//! (`OMPI_COMM_WORLD_*`), Slurm's `srun` (`SLURM_PROCID`, ...), or nothing (a world of one);
//! and [`init`], which gives a program its world communicator.
//!
//! A restarted attempt of an elastic run sees `PIPEWRIGHT_RESTART=<attempt>` (1, 2, ...): the
//! program goes on from its newest complete checkpoint.
//!
//! The room of everything distributed below the model (as `torch.distributed`): [`comm`], the
//! [`comm::Communicator`] every backend implements (local threads, MPI, NCCL), and
//! [`topology`], where each rank sits in a layout.

pub mod comm;
pub mod topology;

use crate::distributed::comm::Communicator;
use crate::Result;

/// This process's place in the job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Env {
    /// This process's rank in the world.
    pub rank: usize,
    /// Ranks in the world.
    pub world_size: usize,
    /// The rank among the processes of this machine.
    pub local_rank: usize,
    /// Processes on this machine.
    pub local_world_size: usize,
    /// This machine's index.
    pub node_rank: usize,
    /// The attempt of an elastic run (0: the first).
    pub restart: u32,
    /// What started the process: `torchrun` (also `pipewright launch`), `mpirun`, `srun` or
    /// `none`.
    pub launcher: &'static str,
}

impl Env {
    /// Reads the environment (see the module documentation for the order).
    pub fn from_env() -> Self {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`Env::from_env`] over any source of variables.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Self {
        let var = |name: &str| -> Option<usize> { get(name)?.trim().parse().ok() };
        let restart = var("PIPEWRIGHT_RESTART").unwrap_or(0) as u32;
        let read = |rank: &str, size: &str, local: &str, local_size: &str, node: Option<&str>| {
            let (rank, world_size) = (var(rank)?, var(size)?);
            let local_rank = var(local).unwrap_or(0);
            let local_world_size = var(local_size).unwrap_or(world_size).max(1);
            let node_rank = node.and_then(var).unwrap_or(rank / local_world_size);
            Some((rank, world_size, local_rank, local_world_size, node_rank))
        };
        let found = [
            (
                "torchrun",
                read(
                    "RANK",
                    "WORLD_SIZE",
                    "LOCAL_RANK",
                    "LOCAL_WORLD_SIZE",
                    Some("NODE_RANK"),
                ),
            ),
            (
                "mpirun",
                read(
                    "OMPI_COMM_WORLD_RANK",
                    "OMPI_COMM_WORLD_SIZE",
                    "OMPI_COMM_WORLD_LOCAL_RANK",
                    "OMPI_COMM_WORLD_LOCAL_SIZE",
                    None,
                ),
            ),
            (
                "srun",
                read(
                    "SLURM_PROCID",
                    "SLURM_NTASKS",
                    "SLURM_LOCALID",
                    "SLURM_NTASKS_PER_NODE",
                    Some("SLURM_NODEID"),
                ),
            ),
        ]
        .into_iter()
        .find_map(|(l, v)| v.map(|v| (l, v)));
        match found {
            Some((launcher, (rank, world_size, local_rank, local_world_size, node_rank))) => Self {
                rank,
                world_size,
                local_rank,
                local_world_size,
                node_rank,
                restart,
                launcher,
            },
            None => Self {
                rank: 0,
                world_size: 1,
                local_rank: 0,
                local_world_size: 1,
                node_rank: 0,
                restart,
                launcher: "none",
            },
        }
    }

    /// Whether Open MPI started this process (directly or under `pipewright launch`).
    pub fn under_mpi() -> bool {
        std::env::var_os("OMPI_COMM_WORLD_SIZE").is_some()
    }
}

/// The folder of a run directory where `pipewright launch` keeps its ranks' heartbeats (made
/// before the first rank starts).
pub const HEARTBEAT_DIR: &str = ".heartbeat";

/// The launcher's record of its attempts, in the run directory.
pub const LAUNCH_RECORD: &str = "launch.json";

/// Reports that this rank finished `step` to a launcher watching for hung ranks: writes the
/// step to `$PIPEWRIGHT_HEARTBEAT_DIR/rank-<RANK>` (nothing when the variable is unset).
pub fn heartbeat(step: u64) -> Result<()> {
    let Some(dir) = std::env::var_os("PIPEWRIGHT_HEARTBEAT_DIR") else {
        return Ok(());
    };
    let dir = std::path::PathBuf::from(dir);
    let path = dir.join(format!("rank-{}", Env::from_env().rank));
    std::fs::write(&path, step.to_string())
        .map_err(|e| crate::Error::io("cannot write heartbeat", &path, e))
}

/// A flag that SIGTERM (a preemption notice), SIGUSR1 (what `pipewright launch` forwards
/// through mpirun) and SIGINT (Ctrl-C) set: a training loop reads it between steps, and every
/// rank then saves and stops ([`crate::trainer::Hooks::stop_requested`]). A second SIGINT
/// while the flag is set ends the process at once (the default action): files a run appends
/// to are written whole rows at a time and checkpoints are renamed into place, so even that
/// leaves nothing torn.
pub fn preemption_flag() -> Result<std::sync::Arc<std::sync::atomic::AtomicBool>> {
    use signal_hook::consts::{SIGINT, SIGTERM, SIGUSR1};
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watch = |e| crate::Error::io("cannot watch for signals", "SIGTERM, SIGINT", e);
    // Registered first, so that it sees the flag as the previous signal left it.
    signal_hook::flag::register_conditional_default(SIGINT, flag.clone()).map_err(watch)?;
    for sig in [SIGTERM, SIGUSR1, SIGINT] {
        signal_hook::flag::register(sig, flag.clone()).map_err(watch)?;
    }
    Ok(flag)
}

/// A program's world: its communicator, and MPI kept alive while it is.
pub struct World {
    /// Every rank of the job.
    pub comm: Box<dyn Communicator>,
    guard: Guard,
}

/// Keeps MPI initialised while it lives (MPI is finalised when it drops).
pub struct Guard {
    #[cfg(feature = "mpi")]
    _mpi: Option<crate::distributed::comm::mpi::Mpi>,
}

impl World {
    /// The communicator, to hand on, and the guard to keep while it is used.
    pub fn into_parts(self) -> (Box<dyn Communicator>, Guard) {
        (self.comm, self.guard)
    }
}

/// `mpirun` for `np` ranks with the settings this project's machines need: allowed as root,
/// more ranks than cores, and no cross-memory attach (containers forbid ptrace). Add the
/// program and its arguments (and any more options) to it.
pub fn mpirun(np: usize) -> std::process::Command {
    let mut cmd = std::process::Command::new("mpirun");
    cmd.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .args([
            "--oversubscribe",
            "--mca",
            "btl_vader_single_copy_mechanism",
            "none",
        ])
        .args(["-np", &np.to_string()]);
    cmd
}

/// The world communicator of this process: over Open MPI when `mpirun` (or `pipewright
/// launch`) started it, a world of one otherwise. Under mpirun without the `mpi` feature it is
/// an error that says how to build.
pub fn init() -> Result<World> {
    if Env::under_mpi() {
        #[cfg(feature = "mpi")]
        {
            let (mpi, comm) = crate::distributed::comm::mpi::Mpi::init()?;
            return Ok(World {
                comm: Box::new(comm),
                guard: Guard { _mpi: Some(mpi) },
            });
        }
        #[cfg(not(feature = "mpi"))]
        return Err(crate::invalid!(
            "this process was started by mpirun but pipewright was built without MPI: build \
             with the `mpi` feature (tools/install-mpi.sh installs Open MPI)"
        ));
    }
    Ok(World {
        comm: Box::new(crate::distributed::comm::local::LocalComm::single()),
        guard: Guard {
            #[cfg(feature = "mpi")]
            _mpi: None,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Env {
        Env::from_vars(|n| {
            vars.iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.to_string())
        })
    }

    #[test]
    fn every_launcher_is_read() {
        let t = env(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("NODE_RANK", "1"),
            ("PIPEWRIGHT_RESTART", "2"),
            ("OMPI_COMM_WORLD_RANK", "0"),
        ]);
        assert_eq!(
            (t.rank, t.world_size, t.local_rank, t.local_world_size),
            (5, 8, 1, 4)
        );
        assert_eq!((t.node_rank, t.restart, t.launcher), (1, 2, "torchrun"));
        let m = env(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]);
        // Two ranks a node: rank 3 is on the second.
        assert_eq!(
            (m.rank, m.local_rank, m.node_rank, m.launcher),
            (3, 1, 1, "mpirun")
        );
        let s = env(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NTASKS_PER_NODE", "4"),
            ("SLURM_NODEID", "1"),
        ]);
        assert_eq!(
            (s.rank, s.world_size, s.node_rank, s.launcher),
            (6, 8, 1, "srun")
        );
        let none = env(&[("RANK", "two")]);
        assert_eq!((none.rank, none.world_size, none.launcher), (0, 1, "none"));
    }

    #[test]
    fn a_process_started_by_nothing_is_a_world_of_one() {
        // The test runner sets none of the launchers' variables.
        if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_none() && std::env::var_os("RANK").is_none()
        {
            let e = Env::from_env();
            assert_eq!((e.rank, e.world_size, e.launcher), (0, 1, "none"));
            let w = init().unwrap();
            assert_eq!((w.comm.rank(), w.comm.size()), (0, 1));
        }
    }
}
