//! What a pipeline action costs beyond its layers, measured on this machine.
//!
//! A stage's forward action receives its input, runs its layers, keeps what its backward needs
//! and sends its output; its backward action receives the output's gradient and injects it,
//! runs candle's backward, collects the parameters' gradients, sends the input's gradient and
//! frees the store. The profile times the layers alone ([`super::layer_cost`]); the rest is
//! the executor's, paid once an action whatever the stage holds. Traced here (pp 2, one block a
//! stage, 8 rows): forwards 4-23 us and backwards 18-45 us beyond their layers and the gradient
//! sum, where a one-stage pipeline (no messages) runs within 1 % of its layers: sixteen actions
//! a step per rank of an interleaved pp 2 pay it twice as often as 1F1B's eight.
//!
//! Measured as it occurs: the model as a two-stage 1F1B pipeline of four micro-batches (ranks
//! as threads, both computing at once as two profile copies do), each traced action's time
//! (not counting its waits) less its stage's layers as profiled at its rows, and, for a
//! backward after the stage's first micro-batch, less the gradient sum's line; the medians
//! over 100 steps, at least 0 (here 0-11 us a forward and 19-61 us a backward, six profiles in
//! a row). A hundred steps (half a second here) rather than twenty: the trial runs after the
//! profile's rounds, and a slow spell of the machine that covered twenty steps (a tenth of a
//! second) moved the result by its whole length, where the rounds' medians had absorbed it
//! (six profiles in a row gave 13-166 us a backward with twenty).
//! With it, `tools/plan_accuracy.sh`'s interleaved pp 2 x dp 2 went from 12-23 % fast to within
//! 5 %.

use std::ops::Range;

use super::layer_cost::median;
use super::profile::{ActionOverhead, Fit, LayerProfile};
use crate::batch::Batch;
use crate::comm::local;
use crate::loss::SharedLoss;
use crate::model::{Build, Sequential};
use crate::pipeline::partition::unit_bounds;
use crate::pipeline::{Action, Pipeline, PipelineOptions, Recompute, ScheduleKind};
use crate::Result;

/// Steps traced, after two untimed ones: enough to span a slow spell of the machine.
const STEPS: usize = 100;

/// Micro-batches a step (fewer when the batch has fewer rows).
const CHUNKS: usize = 4;

/// [`ActionOverhead`] of `model` as a two-stage pipeline on `batch` (split into 4
/// micro-batches), given its `layers` as profiled here and the gradient sum's line `sum`
/// (seconds by parameters). `None` when the model has fewer than two units to split.
pub fn action_overhead(
    model: &Sequential,
    build: &Build,
    batch: &Batch,
    loss: SharedLoss,
    layers: &[LayerProfile],
    sum: Fit,
) -> Result<Option<ActionOverhead>> {
    if unit_bounds(model).len() < 3 {
        return Ok(None);
    }
    // (At most a micro-batch a row.)
    let chunks = CHUNKS.min(batch.rows()?);
    let per_rank = local::run(2, |c| {
        let opts = PipelineOptions {
            chunks,
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            custom_schedule: None,
            balance: None,
            seed: 0,
            tied: Vec::new(),
            recompute: Recompute::Never,
            deferred_batch_norm: false,
            detect_anomaly: false,
        };
        let mut p = Pipeline::new(model, build, Box::new(c), opts, loss.clone())?;
        let rows = batch.rows()?;
        for _ in 0..2 {
            p.loss_and_grads(batch, rows, 1.0)?;
        }
        let ranges = p.ranges().to_vec();
        p.enable_trace();
        let mut events = Vec::new();
        for _ in 0..STEPS {
            p.loss_and_grads(batch, rows, 1.0)?;
            events.extend(p.take_trace());
        }
        Ok((ranges, events))
    })?;
    let rows = batch.split(chunks)?[0].rows()?;
    // A stage's layers as profiled at the micro-batch's rows: forward, backward, and the
    // gradient sum a backward after the stage's first micro-batch adds.
    let profiled = |stage: &Range<usize>| {
        let of = &layers[stage.clone()];
        let params: u64 = of.iter().map(|l| l.params).sum();
        (
            of.iter().map(|l| l.forward.at(rows)).sum::<f64>(),
            of.iter().map(|l| l.backward.at(rows)).sum::<f64>(),
            sum.at(params as usize),
        )
    };
    let (mut forward, mut backward) = (Vec::new(), Vec::new());
    for (ranges, events) in &per_rank {
        let stages: Vec<_> = ranges.iter().map(profiled).collect();
        for e in events {
            let (f, b, summed) = stages[e.action.stage()];
            let took = (e.dur_us - e.wait_us) * 1e-6;
            match e.action {
                Action::Forward { .. } => forward.push(took - f),
                _ if e.action.mb() > 0 => backward.push(took - b - summed),
                _ => backward.push(took - b),
            }
        }
    }
    Ok(Some(ActionOverhead {
        forward_s: median(forward).max(0.0),
        backward_s: median(backward).max(0.0),
    }))
}
