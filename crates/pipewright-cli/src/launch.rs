//! `pipewright launch`: the flags of [`pipewright::trainer::launch::Launch`], which starts a program's
//! ranks under mpirun and restarts them when one dies, and `rank-env`, what each rank runs
//! first ([`pipewright::trainer::launch::exec_rank`]).

use std::path::PathBuf;

use clap::Args;
use pipewright::trainer::launch::{Launch, Slots};
use pipewright::{invalid, Error, Result};

/// The flags of `pipewright launch`.
#[derive(Args)]
pub struct LaunchArgs {
    /// Ranks on this machine.
    #[arg(long)]
    pub nproc_per_node: Option<usize>,
    /// An Open MPI host file (`host slots=N` lines), read again before every attempt.
    #[arg(long, conflicts_with = "nproc_per_node")]
    pub hostfile: Option<PathBuf>,
    /// Hosts and their slots in Open MPI's syntax (`a:4,b:4`).
    #[arg(long, conflicts_with_all = ["nproc_per_node", "hostfile"])]
    pub hosts: Option<String>,
    /// Attempts after the first when a rank dies.
    #[arg(long, default_value_t = 0)]
    pub max_restarts: u32,
    /// Where `launch.json` goes (default: the program's `--out`, else this directory).
    #[arg(long)]
    pub run_dir: Option<PathBuf>,
    /// Seconds a rank may go without finishing a step (its heartbeat) before the attempt is
    /// ended and restarted as hung (0: never).
    #[arg(long, default_value_t = 300.0, value_parser = crate::train::finite)]
    pub heartbeat_timeout: f64,
    /// More arguments for mpirun (repeat it for each).
    #[arg(long, allow_hyphen_values = true)]
    pub mpirun_arg: Vec<String>,
    /// The program and its arguments, after `--`.
    #[arg(last = true, required = true)]
    pub program: Vec<String>,
}

/// The program's flag `flag`'s value, if it gives one.
fn program_flag<'a>(a: &'a LaunchArgs, flag: &str) -> Option<&'a String> {
    let i = a.program.iter().position(|w| w == flag)?;
    a.program.get(i + 1)
}

/// `pipewright launch ARGS`: `launch.json` in `--run-dir`, else the program's `--out`, else
/// here; the checkpoints the program's `--checkpoint-dir`, else `<run dir>/checkpoints`.
pub fn run(a: LaunchArgs) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| Error::io("cannot find", "pipewright", e))?;
    let run_dir = a
        .run_dir
        .clone()
        .or_else(|| program_flag(&a, "--out").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("."));
    let checkpoint_dir = program_flag(&a, "--checkpoint-dir")
        .map_or_else(|| run_dir.join("checkpoints"), PathBuf::from);
    let slots = match (a.nproc_per_node, &a.hostfile, &a.hosts) {
        (Some(n), _, _) => Slots::PerNode(n),
        (_, Some(f), _) => Slots::Hostfile(f.clone()),
        (_, _, Some(h)) => Slots::Hosts(h.clone()),
        _ => {
            return Err(invalid!(
                "say where the ranks run: --nproc-per-node N, --hostfile FILE or --hosts a:4,b:4"
            ))
        }
    };
    Launch {
        slots,
        max_restarts: a.max_restarts,
        run_dir,
        checkpoint_dir,
        heartbeat_timeout: a.heartbeat_timeout,
        mpirun_args: a.mpirun_arg,
        wrapper: vec![
            exe.to_string_lossy().into_owned(),
            "rank-env".into(),
            "--".into(),
        ],
        program: a.program,
    }
    .run()
}
