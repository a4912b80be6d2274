//! What a step costs besides its layers, measured over a model's parameters on this machine:
//! the update after the pipeline schedule (the gradients' conversion to f32 masters, the
//! overflow check, their global norm, the clip's scale and the AdamW update: the functions the
//! Varuna step calls) and the sum of each micro-batch's gradients into the step's running sum
//! (every backward after a stage's first). Each update is timed after a forward and backward
//! of the model, as the step runs it after its schedule: timed back to back, the update found
//! its state in the caches, where the schedule's activations had pushed it out (measured here
//! with `plan --measure`'s step parts: back to back predicted 0.32-0.38 ms for updates that took
//! 0.41-0.52 ms in training, 0.61 for 0.84 on dp 2). The planner's model of the update from memory
//! bandwidth (28 bytes a parameter) is a bound the CPU beats by far while a small model's
//! state stays in cache (here: 0.2 ms for 0.4 M parameters on one thread, about 50 GB/s,
//! where the bound says 1.4 ms), so a measured profile carries its own lines.

use std::time::Instant;

use candle_core::Var;

use super::layer_cost::{median, profile_stage};
use super::profile::Fit;
use crate::model::batch::Batch;
use crate::model::grads::Grads;
use crate::model::nn::optim::{scale_to_norm, AdamW, AdamWConfig, Optimizer};
use crate::model::precision::{has_overflow, to_master_grads};
use crate::model::{Build, Sequential, Stage};
use crate::parallel::loss::Loss;
use crate::Result;

/// Random gradients for `params`.
fn random_grads(params: &[(String, Var)]) -> Result<Grads> {
    let mut grads = Grads::new();
    for (name, v) in params {
        grads.insert(name.clone(), v.as_tensor().randn_like(0.0, 1.0)?);
    }
    Ok(grads)
}

/// What runs before each timed update: a forward and backward of a stage on a batch.
pub struct Before<'a> {
    /// The batch the model passes over.
    pub batch: &'a Batch,
    /// The last layer's loss, if the model ends in one.
    pub loss: Option<&'a dyn Loss>,
}

/// Seconds of one update of `params` with random gradients: the median of `repeats` timings
/// (after one untimed step, which allocates the moments), each after `before` on `stage`.
fn time_update(
    stage: &Stage,
    params: Vec<(String, Var)>,
    repeats: usize,
    before: &Before,
) -> Result<f64> {
    let grads = random_grads(&params)?;
    let mut opt = AdamW::new(params, AdamWConfig::default())?;
    opt.step(&grads, 1e-3)?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        profile_stage(stage, before.batch, 1, before.loss)?;
        let t = Instant::now();
        let mut g = to_master_grads(&grads, 1.0)?;
        has_overflow(&g)?;
        let norm = g.norm()?;
        scale_to_norm(&mut g, norm, 1.0)?;
        opt.step(&g, 1e-3)?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(median(times))
}

/// Seconds of adding one micro-batch's random gradients of `params` into a running sum: the
/// median of `repeats` timings.
fn time_sum(params: Vec<(String, Var)>, repeats: usize) -> Result<f64> {
    let grads = random_grads(&params)?;
    let mut sum = grads.clone();
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats.max(1) {
        let g = grads.clone();
        let t = Instant::now();
        sum.accumulate(g)?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(median(times))
}

/// `time`'s seconds as a line in the parameters it covers (a [`Fit`] whose rows are
/// parameters): timed over all of `model`'s parameters and over its largest layer's.
fn per_parameter(
    model: &Sequential,
    build: &Build,
    time: impl Fn(&Stage, Vec<(String, Var)>) -> Result<f64>,
) -> Result<Fit> {
    let stage = model.build(build)?;
    let count = |p: &[(String, Var)]| p.iter().map(|(_, v)| v.elem_count()).sum::<usize>();
    let all = stage.params();
    let largest = stage
        .layers()
        .iter()
        .map(|l| l.params())
        .max_by_key(|p| count(p))
        .unwrap_or_default();
    let mut points = vec![(count(&all) as f64, time(&stage, all)?)];
    if count(&largest) > 0 && count(&largest) < points[0].0 as usize {
        points.push((count(&largest) as f64, time(&stage, largest)?));
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

/// The update's seconds as a line in the parameters updated, the median of `repeats`
/// timings over all of `model`'s parameters and over its largest layer's, each after
/// `before` (a pass over the model, as in a training step).
pub fn time_optimizer(
    model: &Sequential,
    build: &Build,
    repeats: usize,
    before: &Before,
) -> Result<Fit> {
    per_parameter(model, build, |s, p| time_update(s, p, repeats, before))
}

/// The seconds of summing one micro-batch's gradients into the running sum, as a line in the
/// parameters summed, timed as [`time_optimizer`] times the update.
pub fn time_accumulate(model: &Sequential, build: &Build, repeats: usize) -> Result<Fit> {
    per_parameter(model, build, |_, p| time_sum(p, repeats))
}
