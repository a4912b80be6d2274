//! Morphing (Varuna): a restarted attempt given a world of another size takes a layout of
//! that world that keeps the global batch, the micro-batch size, the schedule and the recompute
//! mode, and fits the model (heads and vocabulary divisible by tp, enough cut points for pp).
//! Of those, a GPT takes the planner's fastest on `--hardware` (predicted from its shapes, the
//! launcher's ranks per node as a node); other models, which the planner cannot size without
//! a profile, the one closest to the flags' (the same tp, then the same pp, then the nearest).

use pipewright::dist::Env;
use pipewright::pipeline::schedule::{Schedule, ScheduleKind};
use pipewright::pipeline::Recompute;
use pipewright::plan::{rank, Candidate, Cluster, Hardware, Request};
use pipewright::topology::Layout;
use pipewright::{invalid, Result, Sequential};

use super::{chunk_size, ModelConfig, TrainArgs};

/// Sets `a`'s layout for the world of `env`.
pub fn morph(a: &mut TrainArgs, env: &Env, config: &ModelConfig, model: &Sequential) -> Result<()> {
    let world = env.world_size;
    let chunk = chunk_size(a)?;
    let (kind, v) = (a.schedule.parse::<ScheduleKind>()?, a.virtual_stages);
    let recompute: Recompute = a.recompute.parse()?;
    let divisors = |n: usize| (1..=n).filter(move |d| n.is_multiple_of(*d));
    let mut layouts: Vec<(usize, usize, usize)> = divisors(world)
        .flat_map(|tp| divisors(world / tp).map(move |pp| (pp, tp, world / (tp * pp))))
        .filter(|&(pp, tp, dp)| {
            let tp_ok = match config {
                ModelConfig::Gpt { gpt, .. } => {
                    gpt.n_head.is_multiple_of(tp) && gpt.vocab_size.is_multiple_of(tp)
                }
                ModelConfig::Cnn { .. } => tp == 1,
            };
            tp_ok
                && a.batch_size.is_multiple_of(dp * chunk)
                && Schedule::new(kind, pp, a.batch_size / (dp * chunk), v).is_ok()
                && pipewright::pipeline::partition::partition(model, pp * v, None).is_ok()
        })
        .collect();
    layouts
        .sort_by_key(|&(pp, tp, _)| (tp != a.tp, pp != a.pp, tp.abs_diff(a.tp), pp.abs_diff(a.pp)));
    if layouts.is_empty() {
        return Err(invalid!(
            "no layout of {world} ranks fits the model and a batch of {} in micro-batches of {chunk}",
            a.batch_size
        ));
    }
    let (pp, tp, dp, why) = if matches!(config, ModelConfig::Gpt { .. }) {
        let hw = Hardware::load(&a.hardware)?;
        let profile = crate::plan::shapes_profile(config, &a.precision, &hw)?;
        let candidates = layouts
            .iter()
            .map(|&(pp, tp, dp)| Candidate {
                layout: Layout { pp, tp, dp },
                micro_batch: chunk,
                micro_batches: a.batch_size / (dp * chunk),
                schedule: kind,
                virtual_stages: v,
                recompute,
            })
            .collect();
        let cluster = Cluster {
            hardware: &hw,
            ranks_per_node: env.local_world_size.min(world),
        };
        let req = Request {
            world,
            memory_bytes: hw.memory_bytes() as f64,
            global_batch: a.batch_size,
            top: 1,
        };
        let best = rank(&profile, &cluster, &req, candidates)?.swap_remove(0);
        let Layout { pp, tp, dp } = best.candidate.layout;
        let why = format!(
            "the planner's fastest on {}: {:.1} ms a step predicted",
            a.hardware,
            best.step_s * 1e3
        );
        (pp, tp, dp, why)
    } else {
        let (pp, tp, dp) = layouts[0];
        (pp, tp, dp, "the nearest to the flags'".to_string())
    };
    eprintln!(
        "pipewright train: morphing from pp={} tp={} dp={} to pp={pp} tp={tp} dp={dp} for a world of {world} ({why})",
        a.pp, a.tp, a.dp
    );
    (a.pp, a.tp, a.dp, a.chunk_size, a.balance) = (pp, tp, dp, Some(chunk), None);
    Ok(())
}
