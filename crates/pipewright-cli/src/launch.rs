//! `pipewright launch`: starts a program's ranks with Open MPI's `mpirun` and restarts them
//! when one dies (torchrun's `--max-restarts`). Every rank sees torchrun's variables (`RANK`,
//! `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`)
//! beside Open MPI's, and `PIPEWRIGHT_RESTART=<attempt>` on a restart, so that the program
//! goes on from its newest checkpoint (`pipewright train` does by itself). Each attempt is
//! recorded in `launch.json`.

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Args;
use pipewright::{invalid, Error, Result};
use serde::Serialize;

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

/// The slots of a host file or a `--hosts` list: at least one, at most a layout's
/// [`MAX_WORLD`](pipewright::topology::MAX_WORLD), and on this machine (`--nproc-per-node`) as
/// many as its memory holds (64 MiB a rank at the least).
fn slots(a: &LaunchArgs) -> Result<usize> {
    let n = listed_slots(a)?;
    if n == 0 || n > pipewright::topology::MAX_WORLD {
        return Err(invalid!(
            "{n} ranks: a launch needs at least one and at most {}",
            pipewright::topology::MAX_WORLD
        ));
    }
    if a.nproc_per_node.is_some() {
        pipewright::memory::check_fits(
            n as f64 * 64.0 * 1024.0 * 1024.0,
            &format!("{n} ranks on this machine"),
            "start fewer ranks per node (--nproc-per-node), or list more machines (--hosts)",
        )?;
    }
    Ok(n)
}

fn listed_slots(a: &LaunchArgs) -> Result<usize> {
    if let Some(n) = a.nproc_per_node {
        return Ok(n);
    }
    let parse = |spec: &str, n: Option<&str>| -> Result<usize> {
        n.map_or(Ok(1), |v| v.trim().parse::<usize>())
            .map_err(|_| invalid!("cannot read the slots of `{spec}`"))
    };
    if let Some(h) = &a.hosts {
        return h
            .split(',')
            .map(|spec| parse(spec, spec.split(':').nth(1)))
            .sum();
    }
    if let Some(f) = &a.hostfile {
        let text = std::fs::read_to_string(f).map_err(|e| Error::io("cannot read", f, e))?;
        return text
            .lines()
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
            .sum();
    }
    Err(invalid!(
        "say where the ranks run: --nproc-per-node N, --hostfile FILE or --hosts a:4,b:4"
    ))
}

/// The program's `--out`, where `launch.json` goes by default.
fn run_dir(a: &LaunchArgs) -> PathBuf {
    if let Some(d) = &a.run_dir {
        return d.clone();
    }
    a.program
        .iter()
        .position(|w| w == "--out")
        .and_then(|i| a.program.get(i + 1))
        .map_or_else(|| PathBuf::from("."), PathBuf::from)
}

/// Where the program keeps its checkpoints: its `--checkpoint-dir`, else `<run dir>/checkpoints`.
fn checkpoint_dir(a: &LaunchArgs, run_dir: &Path) -> PathBuf {
    a.program
        .iter()
        .position(|w| w == "--checkpoint-dir")
        .and_then(|i| a.program.get(i + 1))
        .map_or_else(|| run_dir.join("checkpoints"), PathBuf::from)
}

/// The checkpoint an attempt's ranks resume from (the newest intact one, by the rule they
/// follow themselves) and the newer ones they pass over, each with why.
fn resume_point(dir: &Path) -> (Option<String>, Vec<String>) {
    match pipewright::checkpoint::newest_intact(dir) {
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

pub fn run(a: LaunchArgs) -> Result<()> {
    let exe = std::env::current_exe().map_err(|e| Error::io("cannot find", "pipewright", e))?;
    let dir = run_dir(&a);
    let checkpoints = checkpoint_dir(&a, &dir);
    let port = free_port().to_string();
    let mut attempts: Vec<Attempt> = Vec::new();
    // SIGTERM (an eviction notice) and Ctrl-C are passed to the ranks as SIGUSR1, which
    // mpirun forwards: each saves at the end of its step and stops, and the launch ends. A
    // second Ctrl-C ends the attempt at once (saves are atomic: nothing is torn).
    let stop = Arc::new(AtomicBool::new(false));
    let abort = Arc::new(AtomicBool::new(false));
    let watch_err = |e| Error::io("cannot watch for signals", "SIGTERM, SIGINT", e);
    signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone()).map_err(watch_err)?;
    let (s, a2) = (stop.clone(), abort.clone());
    // SAFETY: the handler only swaps and stores atomics, which is async-signal-safe.
    unsafe {
        signal_hook::low_level::register(signal_hook::consts::SIGINT, move || {
            if s.swap(true, Ordering::SeqCst) {
                a2.store(true, Ordering::SeqCst);
            }
        })
    }
    .map_err(watch_err)?;
    for attempt in 0..=a.max_restarts {
        let world = slots(&a)?;
        let beats = dir.join(".heartbeat");
        let _ = std::fs::remove_dir_all(&beats);
        std::fs::create_dir_all(&beats).map_err(|e| Error::io("cannot create", &beats, e))?;
        let mut cmd = pipewright::dist::mpirun(world);
        cmd.env("PIPEWRIGHT_RESTART", attempt.to_string())
            .env("PIPEWRIGHT_HEARTBEAT_DIR", &beats)
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", &port);
        if let Some(f) = &a.hostfile {
            cmd.arg("--hostfile").arg(f);
        }
        if let Some(h) = &a.hosts {
            cmd.args(["--host", h]);
        }
        for v in [
            "PIPEWRIGHT_RESTART",
            "PIPEWRIGHT_HEARTBEAT_DIR",
            "MASTER_ADDR",
            "MASTER_PORT",
        ] {
            cmd.args(["-x", v]);
        }
        cmd.args(&a.mpirun_arg)
            .arg(&exe)
            .arg("rank-env")
            .arg("--")
            .args(&a.program)
            // Its own process group, so that a hung attempt can be ended whole.
            .process_group(0);
        let (resumed_from, skipped) = resume_point(&checkpoints);
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
        let (status, hung) = watch(
            &mut child,
            (&stop, &abort),
            &beats,
            world,
            a.heartbeat_timeout,
        )?;
        let ended_because = match (hung.clone(), status.code(), status.signal()) {
            (Some(why), _, _) => why,
            (None, Some(0), _) if stop.load(Ordering::Relaxed) => {
                "preempted: saved and stopped".to_string()
            }
            (None, Some(0), _) => "finished".to_string(),
            (None, Some(c), _) => format!("exit code {c} (a rank failed or was killed)"),
            (None, None, Some(s)) => format!("signal {s}"),
            (None, None, None) => "unknown".to_string(),
        };
        attempts.push(Attempt {
            attempt,
            started,
            ended: now(),
            world,
            resumed_from,
            skipped,
            exit_code: status.code(),
            signal: status.signal(),
            ended_because,
        });
        record(&dir, &attempts)?;
        if status.success() && hung.is_none() {
            return Ok(());
        }
        if abort.load(Ordering::Relaxed) {
            return Err(invalid!(
                "ended by a second Ctrl-C: the ranks were stopped at once (the newest complete \
                 checkpoint is what a relaunch goes on from)"
            ));
        }
        if stop.load(Ordering::Relaxed) {
            return Err(invalid!("stopped by a signal before the ranks could save"));
        }
        if attempt < a.max_restarts {
            backoff(&attempts, &stop);
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
        a.max_restarts,
        summary.join("; ")
    ))
}

/// Ends an attempt at once: the ranks (mpirun's children, in process groups of their own),
/// then mpirun's group.
fn kill_attempt(child: &Child) {
    for pid in children(child.id()) {
        // SAFETY: signalling processes this launcher started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    // SAFETY: as above, mpirun's own process group.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
}

/// Waits for mpirun: forwards a preemption notice, and ends the attempt (every process of its
/// group) when a rank's heartbeat is older than `timeout` seconds. Returns the exit status and,
/// for a hang, why it was ended.
fn watch(
    child: &mut Child,
    (stop, abort): (&AtomicBool, &AtomicBool),
    beats: &Path,
    world: usize,
    timeout: f64,
) -> Result<(ExitStatus, Option<String>)> {
    let started = Instant::now();
    let mut forwarded = false;
    loop {
        if let Some(s) = child
            .try_wait()
            .map_err(|e| Error::io("cannot wait for", "mpirun", e))?
        {
            return Ok((s, None));
        }
        if stop.load(Ordering::Relaxed) && !forwarded {
            // SAFETY: signalling a child process this launcher started.
            unsafe { libc::kill(child.id() as i32, libc::SIGUSR1) };
            forwarded = true;
        }
        if abort.load(Ordering::Relaxed) {
            kill_attempt(child);
            let s = child
                .wait()
                .map_err(|e| Error::io("cannot wait for", "mpirun", e))?;
            return Ok((s, Some("a second Ctrl-C: ended".into())));
        }
        if timeout > 0.0 {
            let silent = (0..world).find_map(|r| {
                let last = std::fs::metadata(beats.join(format!("rank-{r}")))
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .unwrap_or_else(|| started.elapsed());
                (last.as_secs_f64() > timeout).then_some((r, last.as_secs_f64()))
            });
            if let Some((r, secs)) = silent {
                kill_attempt(child);
                let s = child
                    .wait()
                    .map_err(|e| Error::io("cannot wait for", "mpirun", e))?;
                let why =
                    format!("heartbeat: rank {r} finished no step for {secs:.0} s (hung); ended");
                return Ok((s, Some(why)));
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The processes whose parent is `pid` (from /proc).
fn children(pid: u32) -> Vec<i32> {
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    rd.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit(')')
                        .next()?
                        .split_whitespace()
                        .nth(1)?
                        .parse::<u32>()
                        .ok()
                })
                == Some(pid)
        })
        .collect()
}

/// Writes `launch.json` atomically.
fn record(dir: &Path, attempts: &[Attempt]) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io("cannot create", dir, e))?;
    let text = serde_json::to_string_pretty(&serde_json::json!({ "attempts": attempts }))
        .map_err(|e| invalid!("{e}"))?;
    pipewright::files::write_atomic(&dir.join("launch.json"), text.as_bytes())
}

/// `pipewright rank-env -- PROGRAM ARGS`: what the launcher runs in each rank: sets torchrun's
/// variables from Open MPI's and becomes the program.
pub fn rank_env(program: &[String]) -> Result<()> {
    let env = pipewright::dist::Env::from_env();
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
