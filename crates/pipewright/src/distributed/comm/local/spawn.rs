//! Starting the ranks of a [`LocalComm`] world as threads and joining them: a rank that
//! errs, panics or cannot start fails the world, so the others leave their collectives.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::{LocalComm, State, World};
use crate::{Error, Result};

/// The receive timeout: `PIPEWRIGHT_COMM_TIMEOUT` seconds, or 300.
pub(super) fn default_timeout() -> Duration {
    let secs = env_number("PIPEWRIGHT_COMM_TIMEOUT")
        .filter(|s| *s > 0.0)
        .unwrap_or(300.0);
    Duration::from_secs_f64(secs)
}

/// The finite number the environment variable `name` holds, if it holds one.
fn env_number(name: &str) -> Option<f64> {
    std::env::var(name)
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| s.is_finite())
}

/// How long a receive of a `world`-rank world polls before it sleeps:
/// `PIPEWRIGHT_COMM_SPIN_US` microseconds if set, else [`spin_for`] this machine's cores.
pub(super) fn default_spin(world: usize) -> Duration {
    let set = env_number("PIPEWRIGHT_COMM_SPIN_US").filter(|s| *s >= 0.0);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    spin_for(world, cores, set)
}

/// The polling time of `world` ranks on `cores` cores: `set` microseconds if given, else 50 us
/// when the ranks fit the cores and none when they do not (a poller would take a computing
/// rank's core).
fn spin_for(world: usize, cores: usize, set: Option<f64>) -> Duration {
    let micros = set.unwrap_or(if world <= cores { 50.0 } else { 0.0 });
    Duration::from_secs_f64(micros * 1e-6)
}

/// Memory a rank thread takes before it computes anything: its stack's reservation and its
/// mailbox (8 MiB).
const RANK_BYTES: f64 = 8.0 * 1024.0 * 1024.0;

/// Runs `f` on `world` ranks (threads) and returns their results in rank order; the first
/// rank failure (error or panic) is the error of the whole run. candle's pools are sized for
/// the ranks sharing the cores first ([`crate::distributed::comm::size_thread_pools`], unless
/// `RAYON_NUM_THREADS` is set).
pub fn run<T, F>(world: usize, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(LocalComm) -> Result<T> + Sync,
{
    run_with_timeout(world, default_timeout(), f)
}

/// [`run`] with an explicit receive timeout.
pub fn run_with_timeout<T, F>(world: usize, timeout: Duration, f: F) -> Result<Vec<T>>
where
    T: Send,
    F: Fn(LocalComm) -> Result<T> + Sync,
{
    if world == 0 {
        return Err(Error::Invalid("a world needs at least one rank".into()));
    }
    // Each rank is a thread with its stack and its share of candle's pool: a million ranks
    // asked for by mistake would abort the process while spawning them.
    crate::runtime::memory::check_fits(
        world as f64 * RANK_BYTES,
        &format!("a world of {world} ranks as threads of one process"),
        "use fewer ranks, or run them as processes on more machines (--backend mpi)",
    )?;
    crate::distributed::comm::size_thread_pools(world);
    let shared = Arc::new(World {
        size: world,
        state: Mutex::new(State::default()),
        cvs: (0..world).map(|_| Condvar::new()).collect(),
        timeout,
        spin: default_spin(world),
    });
    let members = Arc::new((0..world).collect::<Vec<_>>());
    // Each rank's value, or its own error (None: it panicked or never started).
    let mut results: Vec<std::result::Result<T, Option<Error>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world)
            .map(|rank| {
                let comm = LocalComm {
                    world: shared.clone(),
                    group: 0,
                    members: members.clone(),
                    rank,
                    seq: AtomicU64::new(0),
                };
                let (f, world) = (&f, shared.clone());
                let spawned = std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        crate::runtime::memory::set_rank(Some(rank));
                        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(comm))) {
                            Ok(Ok(v)) => Ok(v),
                            Ok(Err(e)) => {
                                world.fail(rank, e.to_string());
                                Err(Some(e))
                            }
                            Err(p) => {
                                world.fail(rank, format!("panicked: {}", panic_message(&*p)));
                                Err(None)
                            }
                        }
                    });
                // A rank that cannot start fails the world, so that the ranks already running
                // leave their collectives with an error instead of waiting for it.
                spawned
                    .map_err(|e| {
                        shared.fail(
                            rank,
                            format!(
                                "its thread could not be started ({e}): run fewer ranks as \
                                 threads, or raise the process's thread limit"
                            ),
                        )
                    })
                    .ok()
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.map_or(Err(None), |h| h.join().unwrap_or(Err(None))))
            .collect()
    });
    if let Some((rank, why)) = shared.lock().failed.take() {
        // The first rank's own error is the run's (a communication error only when it was
        // one); the others' are the echoes of it.
        return Err(match std::mem::replace(&mut results[rank], Err(None)) {
            Err(Some(e)) => on_rank(e, rank, world),
            _ => Error::Comm(format!("rank {rank} failed: {why}")),
        });
    }
    results
        .into_iter()
        .enumerate()
        .map(|(rank, r)| r.map_err(|_| Error::Comm(format!("rank {rank} returned nothing"))))
        .collect()
}

/// Rank `rank`'s own error as the run's: as it is for a world of one; with the rank named
/// for more.
fn on_rank(e: Error, rank: usize, world: usize) -> Error {
    match e {
        _ if world == 1 => e,
        Error::Invalid(m) => Error::Invalid(format!("rank {rank} failed: {m}")),
        Error::State(m) => Error::State(format!("rank {rank} failed: {m}")),
        Error::Comm(m) => Error::Comm(format!("rank {rank} failed: {m}")),
        other => other,
    }
}

/// What a panic said (its `&str` or `String` payload).
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_poll_only_where_they_fit_the_cores() {
        assert_eq!(spin_for(2, 2, None), Duration::from_micros(50));
        assert_eq!(spin_for(1, 2, None), Duration::from_micros(50));
        assert_eq!(spin_for(4, 2, None), Duration::ZERO);
        assert_eq!(spin_for(4, 2, Some(10.0)), Duration::from_micros(10));
        assert_eq!(spin_for(2, 2, Some(0.0)), Duration::ZERO);
    }
}
