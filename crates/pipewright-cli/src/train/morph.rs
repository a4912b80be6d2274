//! Morphing (Varuna) for `pipewright train`: a restarted attempt in a world of another size
//! morphs its [`RunSpec`] ([`RunSpec::morph`]), every model planned from its shapes on
//! `--hardware` (the launcher's ranks per node as a node).

use pipewright::dist::Env;
use pipewright::plan::Hardware;
use pipewright::Result;
use pipewright_models::RunSpec;

use super::TrainArgs;

/// `spec` in the world of `env`, with a line on stderr that says what changed and why.
pub fn morph(a: &TrainArgs, env: &Env, spec: &RunSpec) -> Result<RunSpec> {
    let world = env.world_size;
    let hw = Hardware::load(&a.hardware)?;
    let (morphed, m) = spec.morph(world, Some((&hw, env.local_world_size)))?;
    let why = match m.step_s {
        Some(_) => format!("{} on {}", m.why, a.hardware),
        None => m.why,
    };
    let (from, to) = (spec.train.layout, morphed.train.layout);
    eprintln!("pipewright train: morphing from {from} to {to} for a world of {world} ({why})");
    Ok(morphed)
}
