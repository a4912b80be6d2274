//! Watching an attempt: the launcher's signals, the heartbeats, and ending an attempt whole.

use std::path::Path;
use std::process::{Child, ExitStatus};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// The launcher's signals: `stop` on SIGTERM or a first Ctrl-C (forwarded to the ranks as
/// SIGUSR1: they save and stop), `abort` on a second Ctrl-C (the attempt is ended at once).
pub(super) struct Signals {
    pub stop: Arc<AtomicBool>,
    pub abort: Arc<AtomicBool>,
}

impl Signals {
    /// Watches for SIGTERM and SIGINT from now on.
    pub fn watch() -> Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let abort = Arc::new(AtomicBool::new(false));
        let watch_err = |e| Error::io("cannot watch for signals", "SIGTERM, SIGINT", e);
        signal_hook::flag::register(signal_hook::consts::SIGTERM, stop.clone())
            .map_err(watch_err)?;
        let (s, a) = (stop.clone(), abort.clone());
        // SAFETY: the handler only swaps and stores atomics, which is async-signal-safe.
        unsafe {
            signal_hook::low_level::register(signal_hook::consts::SIGINT, move || {
                if s.swap(true, Ordering::SeqCst) {
                    a.store(true, Ordering::SeqCst);
                }
            })
        }
        .map_err(watch_err)?;
        Ok(Self { stop, abort })
    }
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
pub(super) fn watch(
    child: &mut Child,
    signals: &Signals,
    beats: &Path,
    world: usize,
    timeout: f64,
) -> Result<(ExitStatus, Option<String>)> {
    let (stop, abort) = (&signals.stop, &signals.abort);
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
