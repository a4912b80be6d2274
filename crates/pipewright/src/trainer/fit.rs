//! [`fit`]: the one training loop. `pipewright train`, the examples and a user's program all
//! run their steps through it; what differs between them (where batches come from, what an
//! evaluation measures, what is recorded and printed, what a checkpoint stores) are
//! [`Hooks`].
//!
//! Every rank calls `fit` with the same [`Cadence`]. Per step, in this order: the batch
//! ([`Hooks::batch`]), the step, an evaluation when the cadence says so
//! ([`Hooks::evaluate`]), [`Hooks::after_step`], a checkpoint when the cadence says so (every
//! `checkpoint_every` steps and at the last step) or when any rank was asked to stop ([`Hooks::checkpoint`]; background unless stopping), then the
//! heartbeat `pipewright launch` watches ([`crate::distributed::heartbeat`]). A run whose trainer was
//! restored from a checkpoint goes on from the step it had taken.

use std::time::Instant;

use serde_json::json;

use crate::engine::checkpoint::CheckpointOptions;
use crate::engine::spec::Cadence;
use crate::engine::varuna::StepOutcome;
use crate::experiment::Context;
use crate::model::batch::Batch;
use crate::Result;

/// What one step of [`fit`] did, for [`Hooks::after_step`].
#[derive(Clone, Copy, Debug)]
pub struct StepDone {
    /// Steps taken after this one (this step's number plus one).
    pub steps: u64,
    /// The trainer's report (loss, learning rate, overflow, gradient norm).
    pub outcome: StepOutcome,
    /// Seconds the step itself took (no evaluation or checkpoint).
    pub seconds: f64,
    /// The evaluation's metric when this step evaluated and the program has one.
    pub metric: Option<f64>,
    /// Whether this step evaluated.
    pub evaluated: bool,
    /// Whether the cadence marks this step for logging.
    pub log: bool,
    /// Whether this is the run's last step.
    pub last: bool,
    /// Steps of this attempt skipped so far, this one included, because a gradient
    /// overflowed (an f16 run's loss scale then falls).
    pub skipped: u64,
}

/// What differs between training programs; every rank's `fit` calls the same hooks in the
/// same order.
pub trait Hooks {
    /// The batch of step `step` (counted from 0) on this rank: its data-parallel replica's
    /// rows.
    fn batch(&mut self, cx: &mut Context, step: u64) -> Result<Batch>;

    /// An evaluation after `steps` steps (collective): the metric, when the program has one.
    fn evaluate(&mut self, cx: &mut Context, steps: u64) -> Result<Option<f64>> {
        let _ = (cx, steps);
        Ok(None)
    }

    /// After [`Hooks::evaluate`]: the parts of its metric by name (a blend's held-out
    /// perplexity of each dataset), which the run's record keeps as `metric/<name>`; none by
    /// default.
    fn metric_parts(&mut self) -> Vec<(String, f64)> {
        Vec::new()
    }

    /// After every step: record, print, draw.
    fn after_step(&mut self, cx: &mut Context, done: &StepDone) -> Result<()> {
        let _ = (cx, done);
        Ok(())
    }

    /// Saves the context after `steps` steps (collective; in the background when asked).
    /// By default with the step in `state.json`'s `extra` as `next_step`.
    fn checkpoint(&mut self, cx: &mut Context, steps: u64, background: bool) -> Result<()> {
        let opts = CheckpointOptions {
            extra: json!({ "next_step": steps }),
            ..CheckpointOptions::default()
        };
        cx.save(opts, background)
    }

    /// Whether this rank was asked to stop (a preemption notice, see
    /// [`crate::distributed::preemption_flag`]); every rank then saves the step and returns.
    fn stop_requested(&self) -> bool {
        false
    }
}

/// What [`fit`] did.
#[derive(Clone, Debug, PartialEq)]
pub struct FitReport {
    /// The step the run started from (0, or a restored checkpoint's).
    pub first: u64,
    /// Steps taken when it returned.
    pub steps: u64,
    /// The last step's loss (NaN if none ran).
    pub last_loss: f64,
    /// The last evaluation's metric (NaN if none).
    pub metric: f64,
    /// Each step's own seconds, in order.
    pub step_seconds: Vec<f64>,
    /// Seconds of the whole loop.
    pub seconds: f64,
    /// Whether it returned early because a rank was asked to stop.
    pub stopped: bool,
}

impl FitReport {
    /// The median of the steps' own times (evaluation and checkpoints left out).
    pub fn median_step_seconds(&self) -> f64 {
        crate::plan::median(self.step_seconds.clone())
    }
}

/// Trains the context's step engine ([`Context::set_engine`]) to `cadence.steps` steps (see the
/// module's text for the order of things). Collective: every rank calls it.
pub fn fit(cx: &mut Context, cadence: &Cadence, hooks: &mut dyn Hooks) -> Result<FitReport> {
    cadence.validate()?;
    let first = cx.engine()?.pipeline().steps_taken();
    let start = Instant::now();
    let mut report = FitReport {
        first,
        steps: first,
        last_loss: f64::NAN,
        metric: f64::NAN,
        step_seconds: Vec::new(),
        seconds: 0.0,
        stopped: false,
    };
    let mut skipped = 0;
    for step in first..cadence.steps {
        let batch = hooks.batch(cx, step)?;
        let t = Instant::now();
        let outcome = cx.engine()?.step(&batch)?;
        let seconds = t.elapsed().as_secs_f64();
        let steps = step + 1;
        let last = steps == cadence.steps;
        let evaluated = steps.is_multiple_of(cadence.eval_every) || last;
        let metric = if evaluated {
            hooks.evaluate(cx, steps)?
        } else {
            None
        };
        skipped += u64::from(outcome.overflow);
        let done = StepDone {
            skipped,
            steps,
            outcome,
            seconds,
            metric,
            evaluated,
            log: step.is_multiple_of(cadence.log_every) || evaluated,
            last,
        };
        hooks.after_step(cx, &done)?;
        (report.steps, report.last_loss) = (steps, outcome.loss);
        report.step_seconds.push(seconds);
        if let Some(m) = metric {
            report.metric = m;
        }
        // A run that checkpoints also saves its last step, so that what it ends with is what
        // `ckpt export` and a resume find (`--steps 25 --checkpoint-every 10` saves 25 too).
        let saving = cadence.checkpoint_every > 0
            && (steps.is_multiple_of(cadence.checkpoint_every) || last);
        let stop = cx.engine()?.any_rank(hooks.stop_requested())?;
        if saving || stop {
            hooks.checkpoint(cx, steps, cadence.async_checkpoint && !stop)?;
        }
        crate::distributed::heartbeat(steps)?;
        if stop {
            report.stopped = true;
            break;
        }
    }
    cx.engine()?.finish_checkpoint()?;
    report.seconds = start.elapsed().as_secs_f64();
    // A run whose last step's loss is not a number did not train, whatever it skipped on the
    // way (an f16 run skips overflowing steps, and may reach its last step before its loss
    // scaler gives up): it fails, after its rows and checkpoint are written.
    if report.steps > report.first && !report.last_loss.is_finite() {
        return Err(crate::Error::NonFiniteLoss {
            step: report.steps,
            loss: report.last_loss,
        });
    }
    Ok(report)
}
