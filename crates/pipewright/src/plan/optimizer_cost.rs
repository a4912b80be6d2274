//! What a step costs after its pipeline schedule, measured: the gradients' finite check, their
//! global norm, the clip's scale and the AdamW update, timed over a model's parameters on this
//! machine. The planner's model of the same work from memory bandwidth (28 bytes a parameter)
//! is a bound the CPU beats by far while a small model's state stays in cache (here: 0.2 ms
//! for 0.4 M parameters on one thread, about 50 GB/s, where the bound says 1.4 ms), so a
//! measured profile carries its own line.

use std::time::Instant;

use candle_core::Var;

use super::layer_cost::median;
use super::profile::Fit;
use crate::grads::{all_finite, Grads};
use crate::model::{Build, Sequential};
use crate::nn::optim::{scale_to_norm, AdamW, AdamWConfig, Optimizer};
use crate::Result;

/// Seconds of one update of `params` with random gradients: the median of `repeats` timings
/// (after one untimed step, which allocates the moments).
fn time_update(params: Vec<(String, Var)>, repeats: usize) -> Result<f64> {
    let mut grads = Grads::new();
    for (name, v) in &params {
        grads.insert(name.clone(), v.as_tensor().randn_like(0.0, 1.0)?);
    }
    let mut opt = AdamW::new(params, AdamWConfig::default())?;
    opt.step(&grads, 1e-3)?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        let mut g = grads.clone();
        let t = Instant::now();
        for (_, x) in g.iter() {
            all_finite(x)?;
        }
        let norm = g.norm()?;
        scale_to_norm(&mut g, norm, 1.0)?;
        opt.step(&g, 1e-3)?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(median(times))
}

/// The update's seconds as a line in the parameters updated (a [`Fit`] whose rows are
/// parameters): timed over all of `model`'s parameters and over its largest layer's, the
/// median of `repeats` timings each.
pub fn time_optimizer(model: &Sequential, build: &Build, repeats: usize) -> Result<Fit> {
    let stage = model.build(build)?;
    let count = |p: &[(String, Var)]| p.iter().map(|(_, v)| v.elem_count()).sum::<usize>();
    let all = stage.params();
    let largest = stage
        .layers()
        .iter()
        .map(|l| l.params())
        .max_by_key(|p| count(p))
        .unwrap_or_default();
    let mut points = vec![(count(&all) as f64, time_update(all, repeats)?)];
    if count(&largest) > 0 && count(&largest) < points[0].0 as usize {
        points.push((count(&largest) as f64, time_update(largest, repeats)?));
    }
    if points.len() == 1 {
        // One size: all of it per parameter.
        let (n, s) = points[0];
        return Ok(Fit {
            fixed_s: 0.0,
            per_sample_s: if n > 0.0 { s / n } else { 0.0 },
        });
    }
    Ok(Fit::through(&points))
}
