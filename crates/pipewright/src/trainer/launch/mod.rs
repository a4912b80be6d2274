//! Starting a program's ranks with Open MPI's `mpirun` and restarting them when one dies
//! (torchrun's `--max-restarts`; `pipewright launch`). Every rank sees torchrun's variables
//! (`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `NODE_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`) beside Open MPI's ([`exec_rank`] sets them and becomes the program), and
//! `PIPEWRIGHT_RESTART=<attempt>` on a restart, so that the program goes on from its newest
//! checkpoint (the trainer does by itself, [`crate::trainer::Trainer::from_env`]). Each attempt
//! is recorded in `launch.json`.
//!
//! Before every attempt the slots are read again (a host file that shrank or grew gives the
//! next attempt its new world: the program morphs). SIGTERM (an eviction notice) and Ctrl-C
//! reach the ranks as SIGUSR1, which mpirun forwards: each saves at the end of its step and
//! stops, and the launch ends; a second Ctrl-C ends the attempt at once (saves are atomic:
//! nothing is torn). A rank whose heartbeat ([`crate::distributed::heartbeat`]) is older than the
//! timeout ends its attempt as hung. Attempts that fail at once back off (1 s, doubling to
//! 60 s).

mod watch;

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::{invalid, Error, Result};
use watch::{watch, Signals};

/// Where the ranks run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Slots {
    /// This many ranks on this machine.
    PerNode(usize),
    /// An Open MPI host file (`host slots=N` lines), read again before every attempt.
    Hostfile(PathBuf),
    /// Hosts and their slots in Open MPI's syntax (`a:4,b:4`).
    Hosts(String),
}

/// A launch: where its ranks run, what they run, and how often it may restart.
#[derive(Clone, Debug)]
pub struct Launch {
    /// Where the ranks run.
    pub slots: Slots,
    /// Attempts after the first when a rank dies.
    pub max_restarts: u32,
    /// Where `launch.json` and the heartbeats go.
    pub run_dir: PathBuf,
    /// Where the program keeps its checkpoints (each attempt records what it resumes from).
    pub checkpoint_dir: PathBuf,
    /// Seconds a rank may go without finishing a step before its attempt is ended as hung (0:
    /// never).
    pub heartbeat_timeout: f64,
    /// More arguments for mpirun.
    pub mpirun_args: Vec<String>,
    /// What each rank runs before the program to set torchrun's variables (this program's
    /// `rank-env --`, which calls [`exec_rank`]).
    pub wrapper: Vec<String>,
    /// The program and its arguments.
    pub program: Vec<String>,
}

/// One attempt, as `launch.json` records it.
#[derive(Serialize)]
struct Attempt {
    attempt: u32,
    started: f64,
    ended: f64,
    world: usize,
    /// The program's newest intact checkpoint when the attempt started (what it resumes
    /// from), in its `--checkpoint-dir` or `<run dir>/checkpoints`.
    resumed_from: Option<String>,
    /// Newer checkpoints passed over as damaged or incomplete, each with why.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    skipped: Vec<String>,
    exit_code: Option<i32>,
    signal: Option<i32>,
    ended_because: String,
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Waits before the next attempt when the last ones failed at once (within 10 s: a bad flag,
/// a missing file fails the same way again): 1 s, doubling with each such attempt in a row up
/// to 60 s, so that a crash loop does not restart dozens of times a minute. Returns at once on
/// a stop signal.
fn backoff(attempts: &[Attempt], stop: &AtomicBool) {
    let quick = attempts
        .iter()
        .rev()
        .take_while(|t| t.ended - t.started < 10.0)
        .count();
    if quick == 0 {
        return;
    }
    let wait = 2f64.powi(quick as i32 - 1).min(60.0);
    eprintln!("pipewright launch: the attempt failed at once; waiting {wait:.0} s before the next");
    let until = std::time::Instant::now() + std::time::Duration::from_secs_f64(wait);
    while std::time::Instant::now() < until && !stop.load(Ordering::Relaxed) {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// The most ranks one host of `--hosts` or a host file may run.
pub const MAX_SLOTS_PER_HOST: usize = 1024;

impl Slots {
    /// The ranks of the next attempt: at least one, at most a layout's
    /// [`MAX_WORLD`](crate::distributed::topology::MAX_WORLD), and on this machine ([`Slots::PerNode`]) as
    /// many as its memory holds (64 MiB a rank at the least).
    pub fn count(&self) -> Result<usize> {
        let n = self.listed()?;
        if n == 0 || n > crate::distributed::topology::MAX_WORLD {
            return Err(invalid!(
                "{n} ranks: a launch needs at least one and at most {}",
                crate::distributed::topology::MAX_WORLD
            ));
        }
        if let Slots::PerNode(_) = self {
            crate::runtime::memory::check_fits(
                n as f64 * 64.0 * 1024.0 * 1024.0,
                &format!("{n} ranks on this machine"),
                "start fewer ranks per node (--nproc-per-node), or list more machines (--hosts)",
            )?;
        }
        Ok(n)
    }

    fn listed(&self) -> Result<usize> {
        let parse = |spec: &str, n: Option<&str>| -> Result<usize> {
            let n = n
                .map_or(Ok(1), |v| v.trim().parse::<usize>())
                .map_err(|_| invalid!("cannot read the slots of `{spec}`"))?;
            // A machine runs a rank per accelerator or core: a hundred thousand processes on
            // one host would be started before anything failed.
            if n > MAX_SLOTS_PER_HOST {
                return Err(invalid!(
                    "`{spec}` gives one host {n} ranks: at most {MAX_SLOTS_PER_HOST} a host (a \
                     rank per accelerator or core); list more hosts instead"
                ));
            }
            Ok(n)
        };
        match self {
            Slots::PerNode(n) => Ok(*n),
            Slots::Hosts(h) => h
                .split(',')
                .map(|spec| parse(spec, spec.split(':').nth(1)))
                .sum(),
            Slots::Hostfile(f) => {
                let text =
                    std::fs::read_to_string(f).map_err(|e| Error::io("cannot read", f, e))?;
                text.lines()
                    .map(|l| l.split('#').next().unwrap_or("").trim())
                    .filter(|l| !l.is_empty())
                    .map(|l| {
                        parse(
                            l,
                            l.split("slots=")
                                .nth(1)
                                .and_then(|s| s.split_whitespace().next()),
                        )
                    })
                    .sum()
            }
        }
    }
}

/// The checkpoint an attempt's ranks resume from (the newest intact one, by the rule they
/// follow themselves) and the newer ones they pass over, each with why.
fn resume_point(dir: &Path) -> (Option<String>, Vec<String>) {
    match crate::engine::checkpoint::newest_intact(dir) {
        Ok(Some(i)) => (
            i.dir.file_name().map(|n| n.to_string_lossy().to_string()),
            i.skipped.iter().map(ToString::to_string).collect(),
        ),
        Ok(None) => (None, Vec::new()),
        Err(e) => (None, vec![e.to_string()]),
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map_or(29500, |a| a.port())
}

impl Launch {
    /// Runs attempts until one finishes, a stop signal ends the launch, or the restarts are
    /// spent (an error naming every attempt and why it ended).
    pub fn run(&self) -> Result<()> {
        let port = free_port().to_string();
        let mut attempts: Vec<Attempt> = Vec::new();
        let signals = Signals::watch()?;
        for attempt in 0..=self.max_restarts {
            let world = self.slots.count()?;
            let beats = self.run_dir.join(crate::distributed::HEARTBEAT_DIR);
            let _ = std::fs::remove_dir_all(&beats);
            std::fs::create_dir_all(&beats).map_err(|e| Error::io("cannot create", &beats, e))?;
            let mut cmd = self.mpirun(world, attempt, &beats, &port);
            let (resumed_from, skipped) = resume_point(&self.checkpoint_dir);
            for why in &skipped {
                eprintln!("pipewright launch: attempt {attempt}: {why}");
            }
            let started = now();
            eprintln!(
                "pipewright launch: attempt {attempt}: {world} ranks{}",
                resumed_from
                    .as_ref()
                    .map_or(String::new(), |c| format!(", from {c}"))
            );
            let mut child = cmd.spawn().map_err(|e| {
                Error::io(
                    "cannot start",
                    "mpirun (tools/install-mpi.sh installs Open MPI)",
                    e,
                )
            })?;
            let (status, hung) =
                watch(&mut child, &signals, &beats, world, self.heartbeat_timeout)?;
            attempts.push(Attempt {
                attempt,
                started,
                ended: now(),
                world,
                resumed_from,
                skipped,
                exit_code: status.code(),
                signal: status.signal(),
                ended_because: ended_because(&status, hung.clone(), &signals.stop),
            });
            record(&self.run_dir, &attempts)?;
            if status.success() && hung.is_none() {
                return Ok(());
            }
            if signals.abort.load(Ordering::Relaxed) {
                return Err(invalid!(
                    "ended by a second Ctrl-C: the ranks were stopped at once (the newest \
                     complete checkpoint is what a relaunch goes on from)"
                ));
            }
            if signals.stop.load(Ordering::Relaxed) {
                return Err(invalid!("stopped by a signal before the ranks could save"));
            }
            if attempt < self.max_restarts {
                backoff(&attempts, &signals.stop);
            }
        }
        let summary: Vec<String> = attempts
            .iter()
            .map(|t| {
                format!(
                    "attempt {} ({} ranks): {}",
                    t.attempt, t.world, t.ended_because
                )
            })
            .collect();
        Err(invalid!(
            "every attempt failed ({} restarts allowed): {}",
            self.max_restarts,
            summary.join("; ")
        ))
    }

    /// mpirun for attempt `attempt` of `world` ranks, each given the attempt, its heartbeat
    /// directory `beats` and the rendezvous `port`, in a process group of its own (so that a
    /// hung attempt can be ended whole).
    fn mpirun(&self, world: usize, attempt: u32, beats: &Path, port: &str) -> Command {
        let mut cmd = crate::distributed::mpirun(world);
        cmd.env("PIPEWRIGHT_RESTART", attempt.to_string())
            .env("PIPEWRIGHT_HEARTBEAT_DIR", beats)
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port);
        match &self.slots {
            Slots::Hostfile(f) => {
                cmd.arg("--hostfile").arg(f);
            }
            Slots::Hosts(h) => {
                cmd.args(["--host", h]);
            }
            Slots::PerNode(_) => {}
        }
        for v in [
            "PIPEWRIGHT_RESTART",
            "PIPEWRIGHT_HEARTBEAT_DIR",
            "MASTER_ADDR",
            "MASTER_PORT",
        ] {
            cmd.args(["-x", v]);
        }
        cmd.args(&self.mpirun_args)
            .args(&self.wrapper)
            .args(&self.program)
            .process_group(0);
        cmd
    }
}

/// Why an attempt ended, as `launch.json` says it.
fn ended_because(status: &ExitStatus, hung: Option<String>, stop: &AtomicBool) -> String {
    match (hung, status.code(), status.signal()) {
        (Some(why), _, _) => why,
        (None, Some(0), _) if stop.load(Ordering::Relaxed) => {
            "preempted: saved and stopped".to_string()
        }
        (None, Some(0), _) => "finished".to_string(),
        (None, Some(c), _) => format!("exit code {c} (a rank failed or was killed)"),
        (None, None, Some(s)) => format!("signal {s}"),
        (None, None, None) => "unknown".to_string(),
    }
}

/// Writes `launch.json` atomically.
fn record(dir: &Path, attempts: &[Attempt]) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io("cannot create", dir, e))?;
    let text = serde_json::to_string_pretty(&serde_json::json!({ "attempts": attempts }))
        .map_err(|e| invalid!("{e}"))?;
    crate::runtime::files::write_atomic(
        &dir.join(crate::distributed::LAUNCH_RECORD),
        text.as_bytes(),
    )
}

/// What a launched rank runs first (`pipewright rank-env -- PROGRAM ARGS`): sets torchrun's
/// variables from Open MPI's and becomes `program` (returns only if it cannot).
pub fn exec_rank(program: &[String]) -> Result<()> {
    let env = crate::distributed::Env::from_env();
    let Some((prog, args)) = program.split_first() else {
        return Err(invalid!("rank-env needs a program to run"));
    };
    let err = Command::new(prog)
        .args(args)
        .env("RANK", env.rank.to_string())
        .env("LOCAL_RANK", env.local_rank.to_string())
        .env("WORLD_SIZE", env.world_size.to_string())
        .env("LOCAL_WORLD_SIZE", env.local_world_size.to_string())
        .env("NODE_RANK", env.node_rank.to_string())
        .exec();
    Err(Error::io("cannot run", prog, err))
}
