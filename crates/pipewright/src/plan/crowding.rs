//! What a machine loses when more ranks compute at once than it has cores: the crowded
//! efficiency the simulator applies while busy ranks outnumber the cores
//! ([`Sharing`](crate::pipeline::Sharing)).
//!
//! Ranks that share cores take turns: the OS switches between their threads, wakes each on
//! a core another just left, and the caches each thread warmed serve the next; a rank that
//! reaches its step's sums before the others waits with its core free. A fluid model, where
//! `b` busy ranks on `c` cores each run at `c / b` of full speed, misses that. Measured here:
//! four data-parallel ranks of the README's GPT at 16 rows each took 2.21-2.31 times as long
//! a step as two (2.09-2.21 at 64 rows), where fluid sharing says 2; traced, the interleaved
//! pipeline's actions took 7-12 % more CPU time each as two replicas on four ranks than as
//! one on two. The efficiency is measured as throughput: `n` copies of the layers' rounds at
//! once (one per core, each round ending with all of them, as a step ends with its replicas'
//! sums), then `2n` copies, each copy the same work; `2 T(n) / T(2n)` is the share of the
//! cores' speed the crowded copies keep (0.85-0.96 in profiles here, 1 when crowding costs
//! nothing).
//!
//! Tensor-parallel ranks are left out: the waits in their collectives, with a core idle when
//! they run alone, are filled by the other ranks when crowded, which gives back what
//! switching costs (tp 2 x dp 2 took 1.86-2.05 times as long a step as tp 2 alone). Copies of
//! tp groups running the profile's rounds filled more of each other's waits than training
//! did (1.1-1.5 where training gave 1.0), so that measurement is not the model's.

use std::time::Instant;

use super::layer_cost::{median, profile_stage};
use crate::batch::Batch;
use crate::comm::{local, Communicator};
use crate::loss::Loss;
use crate::model::{Build, Sequential};
use crate::Result;

/// Rounds of every layer's timed passes each copy runs in a trial (a round of the README's GPT
/// at 16 rows takes about 4 ms alone: a run long against the OS's time slices of a few
/// milliseconds).
const ROUNDS: usize = 25;

/// Seconds from a common start until the last of `copies` copies (threads of this process)
/// has run [`ROUNDS`] rounds of `model`'s layers on `batch` (after one untimed round each).
fn crowd(
    copies: usize,
    model: &Sequential,
    build: &Build,
    batch: &Batch,
    loss: Option<&dyn Loss>,
) -> Result<f64> {
    let times = local::run(copies, |c| {
        let stage = model.build(build)?;
        profile_stage(&stage, batch, 1, loss)?;
        c.barrier()?;
        let t = Instant::now();
        // Each round ends with every copy at once, as a step ends with its replicas' sums:
        // the copies stay in step, and one that finishes its round early waits, its core free.
        for _ in 0..ROUNDS {
            profile_stage(&stage, batch, 1, loss)?;
            c.barrier()?;
        }
        Ok(t.elapsed().as_secs_f64())
    })?;
    Ok(times.into_iter().fold(0.0, f64::max))
}

/// Trials of the efficiency: each times the copies that fit, then twice as many, and the
/// median of their ratios is kept (a slow spell of the machine, which moves one trial's
/// ratio by 10 % here, then lands on one of three).
const TRIALS: usize = 3;

/// The efficiency `cores` cores keep when twice as many copies of `model`'s layers as there
/// are cores run at once (each 25 rounds on `batch`, in step): the median over 3 trials of
/// `2 T(cores) / T(2 cores)`, within (0, 1] (a crowd that ran faster than twice the time, by
/// noise, counts as 1).
pub fn crowded_efficiency(
    model: &Sequential,
    build: &Build,
    batch: &Batch,
    loss: Option<&dyn Loss>,
    cores: usize,
) -> Result<f64> {
    let mut ratios = Vec::with_capacity(TRIALS);
    for _ in 0..TRIALS {
        let fits = crowd(cores, model, build, batch, loss)?;
        let crowded = crowd(2 * cores, model, build, batch, loss)?;
        ratios.push(2.0 * fits / crowded);
    }
    Ok(median(ratios).clamp(f64::MIN_POSITIVE, 1.0))
}
