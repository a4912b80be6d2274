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
//! its stage's layers as profiled at its rows, and, for a backward after the stage's first
//! micro-batch, less the gradient sum's line. Per step the mean over its forwards and over its
//! backwards (the step pays every action's: the first forward after the update, its caches
//! cold, runs 40 % slower than the others), and the medians over the steps, at least 0: here
//! 2-12 us a forward and 18-51 us a backward (six profiles in a row), the same at 16 rows a
//! micro-batch as at 4 (7-15 and 5-31 us): a cost an action, not a share of its layers.
//!
//! [`measure`](super::measure()) traces three bursts of [`BURST`] steps, before, amid and after
//! the layers' timings, so that the actions and the layers they are set against meet the same
//! speeds of the machine. One trial of twenty steps after the profile (a tenth of a second
//! here) gave 13-166 us a backward over six profiles in a row, and of a hundred steps 29-122:
//! a slow spell of the machine fell on the trial and not on the profile's rounds (whose
//! medians absorb it), or the other way.
//! With it, `tools/plan_accuracy.sh`'s interleaved pp 2 x dp 2 went from 12-23 % fast to within
//! 5 % (eight later runs: -19..+4.5 %, the median -7.5 %; BENCHMARKS.md).

use std::ops::Range;

use super::layer_cost::median;
use super::profile::{ActionOverhead, Fit, LayerProfile};
use crate::batch::Batch;
use crate::comm::local;
use crate::loss::SharedLoss;
use crate::model::{Build, Sequential};
use crate::nn::optim::{AdamW, AdamWConfig, Optimizer};
use crate::pipeline::partition::unit_bounds;
use crate::pipeline::{Action, Pipeline, PipelineOptions, Recompute, ScheduleKind, TraceEvent};
use crate::Result;

/// Steps traced a burst, after two untimed ones; [`measure`](super::measure()) traces three
/// bursts spread over the profile's time.
pub const BURST: usize = 34;

/// Micro-batches a step (fewer when the batch has fewer rows).
const CHUNKS: usize = 4;

/// One rank of the trial: its stages' layer ranges and each traced step's actions.
type RankTrace = (Vec<Range<usize>>, Vec<Vec<TraceEvent>>);

/// The actions of a two-stage pipeline of a model, traced in bursts: what
/// [`ActionTrace::overhead`] compares with the profiled layers.
pub struct ActionTrace {
    /// Rows of each micro-batch.
    rows: usize,
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
            let all_rows = batch.rows()?;
            let mut opt = AdamW::new(p.params().to_vec(), AdamWConfig::default())?;
            let mut steps = Vec::with_capacity(BURST);
            for step in 0..BURST + 2 {
                if step == 2 {
                    p.enable_trace();
                }
                let (_, grads) = p.loss_and_grads(batch, all_rows, 1.0)?;
                opt.step(&grads, 1e-3)?;
                if step >= 2 {
                    steps.push(p.take_trace());
                }
            }
            Ok((p.ranges().to_vec(), steps))
        })?;
        let rows = batch.split(chunks)?[0].rows()?;
        Ok(Some(ActionTrace { rows, per_rank }))
    }

    /// `other`'s steps added to these (the same model and batch).
    pub fn extend(&mut self, other: ActionTrace) {
        for ((_, mine), (_, theirs)) in self.per_rank.iter_mut().zip(other.per_rank) {
            mine.extend(theirs);
        }
    }

    /// [`ActionOverhead`]: each traced action's time (not counting its waits) less its
    /// stage's `layers` as profiled at its rows, and, for a backward after the stage's first
    /// micro-batch, less the gradient sum's line `sum` (seconds by parameters). Per step, the
    /// mean excess of its forwards and of its backwards (a step pays every action's, the cold
    /// first ones too); the medians over the steps, at least 0.
    pub fn overhead(&self, layers: &[LayerProfile], sum: Fit) -> ActionOverhead {
        let profiled = |stage: &Range<usize>| {
            let of = &layers[stage.clone()];
            let params: u64 = of.iter().map(|l| l.params).sum();
            (
                of.iter().map(|l| l.forward.at(self.rows)).sum::<f64>(),
                of.iter().map(|l| l.backward.at(self.rows)).sum::<f64>(),
                sum.at(params as usize),
            )
        };
        let (mut forward, mut backward) = (Vec::new(), Vec::new());
        for (ranges, steps) in &self.per_rank {
            let stages: Vec<_> = ranges.iter().map(profiled).collect();
            for events in steps {
                // (Sum and count of the step's forwards' excess, then of its backwards'.)
                let mut excess = [(0.0, 0usize); 2];
                for e in events {
                    let (f, b, summed) = stages[e.action.stage()];
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
