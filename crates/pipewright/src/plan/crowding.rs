//! What a machine loses when more ranks compute at once than it has cores: the crowded
//! efficiency the simulator applies while busy ranks outnumber the cores
//! ([`Sharing`](crate::parallel::pipeline::Sharing)).
//!
//! Ranks that share cores take turns: the OS switches between their threads, wakes each on
//! a core another just left, and the caches each thread warmed serve the next; a rank that
//! reaches its step's sums before the others waits with its core free. A fluid model, where
//! `b` busy ranks on `c` cores each run at `c / b` of full speed, misses that. Measured here:
//! four data-parallel ranks of the README's GPT at 16 rows each took 2.21-2.31 times as long
//! a step as two (2.09-2.21 at 64 rows), where fluid sharing says 2; traced, the interleaved
//! pipeline's actions took 7-12 % more CPU time each as two replicas on four ranks than as
//! one on two. The efficiency is measured as throughput: `n` copies of the layers' rounds at
//! once (one per core), then `2n` copies, each copy the same work; `2 T(n) / T(2n)` is the
//! share of the cores' speed the crowded copies keep (1 when crowding costs nothing). The
//! copies wait for each other after every pass over the layers, forward or backward, as ranks
//! wait for messages after their actions, so a crowded core switches copies as often as a
//! pipeline's: copies that waited only at the end of each round (four passes) switched at the
//! OS's time slices instead and kept 0.86-0.97 here, where these keep 0.82-0.90 (four
//! profiles each, alternating), and two replicas' pipeline actions (pp 2 x dp 2) took 1.19-1.25
//! times their layers' profiled time against 1.05-1.09 for one replica.
//!
//! Tensor-parallel ranks are left out: the waits in their collectives, with a core idle when
//! they run alone, are filled by the other ranks when crowded, which gives back what
//! switching costs (tp 2 x dp 2 took 1.86-2.05 times as long a step as tp 2 alone). Copies of
//! tp groups running the profile's rounds filled more of each other's waits than training
//! did (1.1-1.5 where training gave 1.0), so that measurement is not the model's. Replicas of
//! one stage run in step and wait together; stages run out of step, and while several are
//! busy each fills the others' waits as far as its measured busy share says
//! ([`Sharing::across`](crate::parallel::pipeline::Sharing)).

use std::time::Instant;

use super::layer_cost::{median, profile_stage, sweep};
use crate::distributed::comm::{local, Communicator};
use crate::model::batch::Batch;
use crate::model::{Activation, Build, Cx, Mode, Sequential};
use crate::parallel::loss::Loss;
use crate::Result;

/// Rounds of every layer's timed passes each copy runs in a trial (a round of the README's GPT
/// at 16 rows takes about 4 ms alone, four passes over the layers).
const ROUNDS: usize = 25;

/// Seconds from a common start until the last of `copies` copies (threads of this process)
/// has run [`ROUNDS`] rounds of `model`'s layers on `batch` (after one untimed round each),
/// all of them waiting for each other after every pass over the layers.
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
        let input = Activation::from_batch(batch, stage.input_names(), "the model")?;
        let mut cx = Cx::new(Mode::Train, 0, 0, 0);
        let loss = loss.map(|l| (l, batch));
        // Every copy waits for the others after each pass over the layers, forward or
        // backward, as a pipeline's ranks wait for each other's messages after their actions:
        // the copies stay in step, one that finishes early waits with its core free, and a
        // crowded core switches to another copy, whose layers find the caches cold.
        let pause = || c.barrier();
        for _ in 0..ROUNDS {
            for split in [true, false] {
                sweep(&stage, &input, &mut cx, split, loss, &pause)?;
            }
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
