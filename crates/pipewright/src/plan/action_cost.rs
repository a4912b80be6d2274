//! What a pipeline action costs beyond its layers, measured on this machine.
//!
//! A stage's forward action receives its input, runs its layers, keeps what its backward needs
//! and sends its output; its backward action receives the output's gradient and injects it,
//! runs candle's backward, collects the parameters' gradients, sends the input's gradient and
//! frees the store. The profile times the layers alone ([`super::layer_cost`]); the rest is
//! the executor's, paid once an action whatever the stage holds. Traced here (pp 2, one block a
//! stage, 8 rows): forwards 4-23 us and backwards 18-45 us beyond their layers and the gradient
//! sum: sixteen actions a step per rank of an interleaved pp 2 pay it twice as often as 1F1B's
//! eight. A one-stage pipeline (no messages) pays it too: the trial below with one-stage
//! pipelines, two at once, gave 0-9 us a forward and 60-97 us a backward of the whole model
//! (four profiles in a row), where the two-stage trial gives 2-12 and 18-51 a stage. The
//! estimate charges the two-stage trial's cost to every action, one stage or many (an earlier
//! trace of a one-stage pipeline alone had found its actions within 1 % of its layers).
//!
//! Measured as it occurs: the model as a two-stage 1F1B pipeline of four micro-batches (ranks
//! as threads, both computing at once as two profile copies do), each step ending in an
//! optimizer update as training's do; each traced action's time (not counting its waits) less
//! its stage's layers timed by its own rank right after that step, as the profile times them
//! (one micro-batch through the whole model, [`profile_stage`], before the update), and, for a
//! backward after the stage's first micro-batch, less the gradient sum's line. Per step the
//! mean over its forwards and over its backwards (the step pays every action's: the first
//! forward after the update, its caches cold, runs 40 % slower than the others), and the
//! medians over the steps, at least 0. Set against the same step's layers, a spell of the
//! machine's speed falls on both sides: six profiles in a row in a slow, unsteady phase
//! (2026-11-26) gave a backward 24-57 us and a forward 6-11, where subtracting the profile's
//! own layer timings (taken between the bursts) gave 9-131 and -23..14 from the same steps. At
//! 16 rows a micro-batch 93-105 and -22..5 us against 58-78 and 8-16 at 4, alternated: a cost
//! an action, rising a little with its rows (the estimate charges the one measured at 4).
//!
//! [`measure`](super::measure()) traces three bursts of [`BURST`] steps, before, amid and after
//! the layers' timings. Before the actions were paired with their own step's layers, the
//! bursts' spread was what set them against the same speeds: one trial of twenty steps after
//! the profile (a tenth of a second here) gave 13-166 us a backward over six profiles in a
//! row, and of a hundred steps 29-122.
//! With the trial, `tools/plan_accuracy.sh`'s interleaved pp 2 x dp 2 went from 12-23 % fast to
//! within 5 % (eight later runs: -19..+4.5 %, the median -7.5 %; BENCHMARKS.md's history).

use std::ops::Range;

use super::layer_cost::{median, profile_stage};
use super::profile::{ActionOverhead, Fit};
use crate::distributed::comm::local;
use crate::model::batch::Batch;
use crate::model::nn::optim::{AdamW, AdamWConfig, Optimizer};
use crate::model::{Build, Sequential};
use crate::parallel::loss::SharedLoss;
use crate::parallel::pipeline::partition::unit_bounds;
use crate::parallel::pipeline::{Action, Pipeline, PipelineOptions, PipelineSpec, TraceEvent};
use crate::Result;

/// Steps traced a burst, after two untimed ones; [`measure`](super::measure()) traces three
/// bursts spread over the profile's time.
pub const BURST: usize = 34;

/// Micro-batches a step (fewer when the batch has fewer rows).
const CHUNKS: usize = 4;

/// One rank of the trial: its stages' layer ranges and each traced step's actions, with every
/// layer's forward and backward seconds timed alone right after them.
type RankTrace = (Vec<Range<usize>>, Vec<(Vec<TraceEvent>, Vec<[f64; 2]>)>);

/// The actions of a two-stage pipeline of a model, traced in bursts: what
/// [`ActionTrace::overhead`] compares with the profiled layers.
pub struct ActionTrace {
    /// Each of the two ranks' stages and steps.
    per_rank: Vec<RankTrace>,
}

impl ActionTrace {
    /// `model` as a two-stage 1F1B pipeline on `batch` (split into 4 micro-batches), `BURST`
    /// steps traced, each ending in an optimizer update as in training (it passes over every
    /// parameter and its moments, and the next step's first actions find their caches cold:
    /// here a first forward 40 % slower than the others). `None` when the model has fewer
    /// than two units to split.
    pub fn burst(
        model: &Sequential,
        build: &Build,
        batch: &Batch,
        loss: SharedLoss,
    ) -> Result<Option<Self>> {
        if unit_bounds(model).len() < 3 {
            return Ok(None);
        }
        // (At most a micro-batch a row.)
        let chunks = CHUNKS.min(batch.rows()?);
        let per_rank = local::run(2, |c| {
            let opts = PipelineOptions {
                spec: PipelineSpec::default(),
                micro_batches: chunks,
                seed: 0,
                tied: Vec::new(),
                detect_anomaly: false,
                cut_last: false,
            };
            let mut p = Pipeline::new(model, build, Box::new(c), opts, loss.clone())?;
            let (whole, first) = (model.build(build)?, batch.split(chunks)?.swap_remove(0));
            let all_rows = batch.rows()?;
            let mut opt = AdamW::new(p.params().to_vec(), AdamWConfig::default())?;
            let mut steps = Vec::with_capacity(BURST);
            for step in 0..BURST + 2 {
                if step == 2 {
                    p.enable_trace();
                }
                let (_, grads) = p.loss_and_grads(batch, all_rows, 1.0)?;
                // The layers alone at once, as the profile times them (the loss with the last).
                let alone = profile_stage(&whole, &first, 1, Some(loss.as_ref()))?;
                opt.step(&grads, 1e-3)?;
                if step >= 2 {
                    let alone = alone.iter().map(|c| [c.forward_s, c.backward_s]).collect();
                    steps.push((p.take_trace(), alone));
                }
            }
            Ok((p.ranges().to_vec(), steps))
        })?;
        Ok(Some(ActionTrace { per_rank }))
    }

    /// `other`'s steps added to these (the same model and batch).
    pub fn extend(&mut self, other: ActionTrace) {
        for ((_, mine), (_, theirs)) in self.per_rank.iter_mut().zip(other.per_rank) {
            mine.extend(theirs);
        }
    }

    /// [`ActionOverhead`]: each traced action's time (not counting its waits) less its
    /// stage's layers as its rank timed them alone after the same step, and, for a backward
    /// after the stage's first micro-batch, less the gradient sum's line `sum` (seconds by the
    /// parameters of its stage's layers, each layer's in `params`). Per step, the mean excess
    /// of its forwards and of its backwards (a step pays every action's, the cold first ones
    /// too); the medians over the steps, at least 0.
    pub fn overhead(&self, params: &[u64], sum: Fit) -> ActionOverhead {
        let (mut forward, mut backward) = (Vec::new(), Vec::new());
        for (ranges, steps) in &self.per_rank {
            // Each stage's gradient sum: the same every step.
            let summed: Vec<f64> = ranges
                .iter()
                .map(|r| sum.at(params[r.clone()].iter().sum::<u64>() as usize))
                .collect();
            for (events, alone) in steps {
                // Each stage's layers alone this step: forward and backward seconds.
                let stages: Vec<[f64; 2]> = ranges
                    .iter()
                    .map(|r| {
                        alone[r.clone()]
                            .iter()
                            .fold([0.0; 2], |[f, b], a| [f + a[0], b + a[1]])
                    })
                    .collect();
                // (Sum and count of the step's forwards' excess, then of its backwards'.)
                let mut excess = [(0.0, 0usize); 2];
                for e in events {
                    let ([f, b], summed) = (stages[e.action.stage()], summed[e.action.stage()]);
                    let took = (e.dur_us - e.wait_us) * 1e-6;
                    let (kind, x) = match e.action {
                        Action::Forward { .. } => (0, took - f),
                        _ if e.action.mb() > 0 => (1, took - b - summed),
                        _ => (1, took - b),
                    };
                    excess[kind].0 += x;
                    excess[kind].1 += 1;
                }
                let [f, b] = excess.map(|(sum, n)| sum / n.max(1) as f64);
                forward.push(f);
                backward.push(b);
            }
        }
        ActionOverhead {
            forward_s: median(forward).max(0.0),
            backward_s: median(backward).max(0.0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_are_set_against_their_own_steps_layers() {
        // Two stages of one layer each (1000 and 3000 parameters; the gradient sum 1 ns a
        // parameter). Each step's layers alone take 100/200 us and 300/400 us (forward /
        // backward) times its speed: two of three steps run 1.5 times slower. Every forward
        // takes 10 us more than its layers that step, every backward 50 more (and the sum
        // after the first micro-batch), a wait on top.
        let params = [1000, 3000];
        let sum = Fit {
            fixed_s: 0.0,
            per_sample_s: 1e-9,
        };
        let alone = [[100e-6, 200e-6], [300e-6, 400e-6]];
        let event = |action, dur_us| TraceEvent {
            step: 0,
            action,
            start_us: 0.0,
            dur_us: dur_us + 7.0,
            recomputed: false,
            wait_us: 7.0,
            cpu_us: None,
        };
        let rank = |stage: usize| -> RankTrace {
            let steps = [1.5, 1.5, 1.0].map(|speed: f64| {
                let times: Vec<[f64; 2]> = alone.iter().map(|t| t.map(|s| s * speed)).collect();
                let [f, b] = times[stage].map(|s| s * 1e6);
                let summed = params[stage] as f64 * 1e-3;
                let events = vec![
                    event(Action::Forward { mb: 0, stage }, f + 10.0),
                    event(Action::Forward { mb: 1, stage }, f + 10.0),
                    event(Action::Backward { mb: 0, stage }, b + 50.0),
                    event(Action::Backward { mb: 1, stage }, b + 50.0 + summed),
                ];
                (events, times)
            });
            (vec![0..1, 1..2], steps.to_vec())
        };
        let trace = ActionTrace {
            per_rank: vec![rank(0), rank(1)],
        };
        let o = trace.overhead(&params, sum);
        assert!((o.forward_s - 10e-6).abs() < 1e-12, "{o:?}");
        assert!((o.backward_s - 50e-6).abs() < 1e-12, "{o:?}");
    }
}
