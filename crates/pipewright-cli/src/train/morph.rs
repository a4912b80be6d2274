//! Morphing (Varuna) for `pipewright train`: the flags of a restarted attempt in a world of
//! another size become a [`MorphRequest`] for the library's [`pipewright::plan::morph`]. A GPT
//! is planned from its shapes on `--hardware` (the launcher's ranks per node as a node); other
//! models, which the planner cannot size without a profile, take the nearest layout.

use pipewright::dist::Env;
use pipewright::plan::{morph as choose, Cluster, Hardware, MorphPlanner, MorphRequest};
use pipewright::topology::Layout;
use pipewright::{Result, Sequential};

use super::{chunk_size, ModelConfig, TrainArgs};

/// Sets `a`'s layout for the world of `env`.
pub fn morph(a: &mut TrainArgs, env: &Env, config: &ModelConfig, model: &Sequential) -> Result<()> {
    let world = env.world_size;
    let chunk = chunk_size(a)?;
    let req = MorphRequest {
        world,
        from: Layout {
            pp: a.pp,
            tp: a.tp,
            dp: a.dp,
        },
        global_batch: a.batch_size,
        micro_batch: chunk,
        schedule: a.schedule.parse()?,
        virtual_stages: a.virtual_stages,
        recompute: a.recompute.parse()?,
        tp_divides: config.tp_divides(),
    };
    // Only the GPT has shapes the planner knows; other models take the nearest layout.
    let hw = match config {
        ModelConfig::Gpt { .. } => Some(Hardware::load(&a.hardware)?),
        ModelConfig::Cnn { .. } => None,
    };
    let profile = match &hw {
        Some(hw) => Some(config.shapes_profile(&a.precision, hw)?),
        None => None,
    };
    let planner = hw
        .as_ref()
        .zip(profile.as_ref())
        .map(|(hw, profile)| MorphPlanner {
            profile,
            cluster: Cluster {
                hardware: hw,
                ranks_per_node: env.local_world_size.min(world),
            },
            memory_bytes: hw.memory_bytes() as f64,
        });
    let m = choose(&req, model, planner)?;
    let Layout { pp, tp, dp } = m.layout;
    let why = match m.step_s {
        Some(_) => format!("{} on {}", m.why, a.hardware),
        None => m.why,
    };
    eprintln!(
        "pipewright train: morphing from pp={} tp={} dp={} to pp={pp} tp={tp} dp={dp} for a world of {world} ({why})",
        a.pp, a.tp, a.dp
    );
    (a.pp, a.tp, a.dp, a.chunk_size, a.balance) = (pp, tp, dp, Some(chunk), None);
    Ok(())
}
