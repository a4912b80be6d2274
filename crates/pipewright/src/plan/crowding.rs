//! What a machine loses when more ranks compute at once than it has cores: the crowded
//! efficiency the simulator applies while busy ranks outnumber the cores
//! ([`Sharing`](crate::pipeline::Sharing)).
//!
//! Ranks that share cores take turns: the OS switches between their threads, wakes each on
//! a core another just left, and the caches and predictors each thread warmed serve the
//! next. A fluid model, where `b` busy ranks on `c` cores each run at `c / b` of full speed,
//! misses that. Measured here (traces, `cpu_us`): the README's GPT's interleaved pipeline ran
//! each action with 7-12 % more CPU time as two replicas on four ranks than as one on two,
//! and a fluid model predicted the four-rank layouts whose ranks are all busy (data-parallel
//! replicas, an interleaved pipeline's) 12-30 % fast. The efficiency is measured as
//! throughput: `n` copies of the layers' rounds at once (one per core), then `2n` copies,
//! each copy the same work; `2 T(n) / T(2n)` is the share of the cores' speed the crowded
//! copies keep (1 when crowding costs nothing; 0.90-0.96 in profiles here).

use std::time::Instant;

use super::layer_cost::profile_stage;
use crate::batch::Batch;
use crate::comm::{local, Communicator};
use crate::loss::Loss;
use crate::model::{Build, Sequential};
use crate::Result;

/// Rounds of every layer's timed passes each copy runs (a round of the README's GPT at 16 rows
/// takes about 4 ms alone: a run long against the OS's time slices of a few milliseconds).
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
        for _ in 0..ROUNDS {
            profile_stage(&stage, batch, 1, loss)?;
        }
        Ok(t.elapsed().as_secs_f64())
    })?;
    Ok(times.into_iter().fold(0.0, f64::max))
}

/// The efficiency `cores` cores keep when twice as many copies of `model`'s layers (each
/// 25 rounds on `batch`) run at once as there are cores: `2 T(cores) / T(2 cores)`,
/// within (0, 1] (a crowd that ran faster than twice the time, by noise, counts as 1).
pub fn crowded_efficiency(
    model: &Sequential,
    build: &Build,
    batch: &Batch,
    loss: Option<&dyn Loss>,
    cores: usize,
) -> Result<f64> {
    let fits = crowd(cores, model, build, batch, loss)?;
    let crowded = crowd(2 * cores, model, build, batch, loss)?;
    Ok((2.0 * fits / crowded).clamp(f64::MIN_POSITIVE, 1.0))
}
