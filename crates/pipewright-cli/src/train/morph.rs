//! Morphing (Varuna) for `pipewright train`: a restarted attempt in a world of another size
//! morphs its [`RunSpec`] ([`RunSpec::morph`]). A GPT is planned from its shapes on
//! `--hardware` (the launcher's ranks per node as a node); other models (the Llama, the CNN), which the planner
//! cannot size without a profile, take the nearest layout.

use pipewright::dist::Env;
use pipewright::plan::Hardware;
use pipewright::Result;
use pipewright_models::{ModelConfig, RunSpec};

use super::TrainArgs;

/// `spec` in the world of `env`, with a line on stderr that says what changed and why.
pub fn morph(a: &TrainArgs, env: &Env, spec: &RunSpec) -> Result<RunSpec> {
    let world = env.world_size;
    let hw = match spec.model {
        ModelConfig::Gpt { .. } => Some(Hardware::load(&a.hardware)?),
        ModelConfig::Llama { .. } | ModelConfig::Cnn { .. } => None,
    };
    let (morphed, m) = spec.morph(world, hw.as_ref().map(|hw| (hw, env.local_world_size)))?;
    let why = match m.step_s {
        Some(_) => format!("{} on {}", m.why, a.hardware),
        None => m.why,
    };
    let (from, to) = (spec.train.layout, morphed.train.layout);
    eprintln!("pipewright train: morphing from {from} to {to} for a world of {world} ({why})");
    Ok(morphed)
}
