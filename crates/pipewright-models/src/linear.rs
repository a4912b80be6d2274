//! Linear layers as the Hugging Face transformers (Llama, Mixtral, Qwen3-MoE) make them:
//! weights drawn from normal(0, 0.02), stored `(out, in)`, no bias.

use pipewright::model::nn::{join, Linear, WeightLayout};
use pipewright::{Build, Result};

/// The linear layer `name`, `inp` to `out`.
pub(crate) fn linear(init: &Build, name: &str, inp: usize, out: usize) -> Result<Linear> {
    let w = init.normal(&join(name, "weight"), &[out, inp], 0.02)?;
    Linear::from_vars(name, w, None, WeightLayout::OutIn)
}
