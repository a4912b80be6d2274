//! How long a rank that waits for a message takes to run again once it is sent, when the
//! ranks outnumber the cores: ranks 0 and 1 (threads of the local backend) take turns, each
//! computing a few products and then sending a time stamp that the other waits for, while
//! ranks 2 and 3 compute matrix products without pause, or idle. Prints the delay from the send
//! to the receiver running: median, 90th percentile and mean.
//!
//! On this machine's two cores (2026-11-25, five runs): idle, 24-28 us median and mean; beside
//! two computing ranks, a 16-17 us median with a 111-139 us mean in four runs (about one
//! message in ten waits for a time slice to end) and 3 / 5 us in one. The planner costs a
//! pipeline send at the link's latency (20 us): under four ranks on two cores a hop on the
//! critical path may cost about 100 us more, and how much varies from run to run
//! (BENCHMARKS.md, "The planner's predictions against measurement").
//!
//! `cargo run --release -p pipewright --example wake_latency`

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use pipewright::distributed::comm::{local, Communicator};
use pipewright::Result;

/// Messages each of ranks 0 and 1 receives.
const TURNS: u64 = 600;

/// One run of four ranks: the delays ranks 0 and 1 saw, with ranks 2 and 3 `busy` or idle.
fn delays(busy: bool) -> Result<Vec<f64>> {
    let epoch = Instant::now();
    let stop = AtomicBool::new(false);
    let mut per_rank = local::run(4, |c| {
        let mut seen = Vec::new();
        if c.rank() < 2 {
            let other = 1 - c.rank();
            let a = Tensor::randn(0f32, 1.0, (128, 128), &Device::Cpu)?;
            for turn in 0..2 * TURNS {
                if turn % 2 == c.rank() as u64 {
                    for _ in 0..4 {
                        a.matmul(&a)?;
                    }
                    let now = Tensor::new(&[epoch.elapsed().as_secs_f64()], &Device::Cpu)?;
                    c.send(&now, other, turn)?;
                } else {
                    let sent = c.recv(other, turn)?.to_vec1::<f64>()?[0];
                    seen.push(epoch.elapsed().as_secs_f64() - sent);
                }
            }
            stop.store(true, Ordering::Relaxed);
        } else if busy {
            let a = Tensor::randn(0f32, 1.0, (256, 256), &Device::Cpu)?;
            while !stop.load(Ordering::Relaxed) {
                a.matmul(&a)?;
            }
        }
        Ok(seen)
    })?;
    let mut all = per_rank.swap_remove(0);
    all.extend(per_rank.swap_remove(0));
    Ok(all)
}

fn main() -> Result<()> {
    pipewright::distributed::comm::size_thread_pools(4);
    // Warm the pools and the allocator once, untimed.
    let _ = Tensor::zeros(1, DType::F32, &Device::Cpu)?;
    for busy in [false, true, false, true] {
        let mut d = delays(busy)?;
        d.sort_by(f64::total_cmp);
        let at = |q: f64| d[((d.len() - 1) as f64 * q) as usize] * 1e6;
        let mean = d.iter().sum::<f64>() / d.len() as f64 * 1e6;
        let others = if busy { "computing" } else { "idle" };
        println!(
            "ranks 2, 3 {others:>9}: send -> receiver running: median {:.0} us, p90 {:.0} us, mean {mean:.0} us",
            at(0.5),
            at(0.9)
        );
    }
    Ok(())
}
