//! The run's record, kept around a program's hooks on the reporting rank: every logged step's
//! loss, learning rate and metric (`scalars.csv`, `tags.csv` and TensorBoard), the metric's
//! parts at each evaluation (`metric/<name>`: a blend's datasets), its seconds and items per
//! second, an f16 run's loss scale and skipped steps, a mixture of experts'
//! load-balancing loss and tokens per expert, and the loss curve drawn
//! at every evaluation; flushed before each checkpoint and at the end, so a checkpoint never
//! holds a step the record lacks. [`crate::trainer::Trainer::train`] keeps it on rank 0;
//! `pipewright train` keeps it with its own hooks; the report page reads it
//! ([`crate::experiment::report`]).

use super::fit::{Hooks, StepDone};
use crate::experiment::recorder::ScalarRow;
use crate::experiment::report::experts::{AUX_LOSS_TAG, EXPERT_LOAD_PREFIX, MAX_OVER_MEAN};
use crate::experiment::report::parts::METRIC_PART_PREFIX;
use crate::experiment::report::{STEP_SECONDS_TAG, THROUGHPUT_TAG};
use crate::experiment::{Context, LinePlot, Recorder};
use crate::model::batch::Batch;
use crate::model::expert_load::ExpertLoad;
use crate::Result;

/// A program's hooks with the run's record (see the module's text). On a rank that does not
/// report (no recorder) it only passes the hooks' calls on.
pub struct Recorded<'a> {
    hooks: &'a mut dyn Hooks,
    rec: Option<Recorder>,
    /// What one step trains on (tokens, rows), for the throughput.
    items_per_step: usize,
    /// Whether the run scales its loss (f16): its scale and skipped steps are recorded.
    scaled: bool,
    /// (steps, loss) of this attempt's steps: the curve drawn at each evaluation.
    curve: Vec<(f64, f64)>,
}

impl<'a> Recorded<'a> {
    /// `hooks` recorded into `rec` (`None` on a rank that does not report), a step being
    /// `items_per_step` items; `scaled` for an f16 run.
    pub fn new(
        hooks: &'a mut dyn Hooks,
        rec: Option<Recorder>,
        items_per_step: usize,
        scaled: bool,
    ) -> Self {
        Self {
            hooks,
            rec,
            items_per_step,
            scaled,
            curve: Vec::new(),
        }
    }

    /// The record flushed (the run's end), and its recorder back.
    pub fn finish(mut self) -> Result<Option<Recorder>> {
        if let Some(rec) = self.rec.as_mut() {
            rec.flush()?;
        }
        Ok(self.rec)
    }

    /// Writes step `d`'s rows (with what its mixtures of experts routed, `loads`).
    fn record(&mut self, d: &StepDone, loads: &[ExpertLoad]) -> Result<()> {
        self.curve.push((d.steps as f64, d.outcome.loss));
        let Some(rec) = self.rec.as_mut() else {
            return Ok(());
        };
        // One numbering everywhere: a step is counted by the steps done with it (1 is the
        // first), in the console, scalars.csv, tags.csv, images and checkpoints alike.
        rec.set_count(d.steps);
        if d.evaluated {
            rec.figure(
                "train/loss_curve",
                &LinePlot::loss_curve(self.curve.clone()),
            )?;
        }
        if !d.log {
            return Ok(());
        }
        rec.record(ScalarRow {
            step: d.steps,
            loss: d.outcome.loss,
            lr: d.outcome.lr,
            metric: d.metric,
        })?;
        rec.scalar(STEP_SECONDS_TAG, d.seconds)?;
        if d.seconds > 0.0 {
            rec.scalar(THROUGHPUT_TAG, self.items_per_step as f64 / d.seconds)?;
        }
        if self.scaled {
            rec.scalar("train/loss_scale", d.outcome.loss_scale)?;
            rec.scalar("train/skipped_steps", d.skipped as f64)?;
        }
        record_loads(rec, loads)
    }
}

/// A step's expert loads: the model's load-balancing loss (each mixture's mean over the
/// micro-batches, summed: what the objective adds, times its coefficient), and each mixture's
/// tokens per expert and their max over mean.
fn record_loads(rec: &mut Recorder, loads: &[ExpertLoad]) -> Result<()> {
    if loads.is_empty() {
        return Ok(());
    }
    rec.scalar(AUX_LOSS_TAG, loads.iter().map(ExpertLoad::mean_aux).sum())?;
    for l in loads {
        let tag = |what: &str| format!("{EXPERT_LOAD_PREFIX}{}/{what}", l.layer);
        rec.scalar(&tag(MAX_OVER_MEAN), l.max_over_mean())?;
        for (e, t) in l.tokens.iter().enumerate() {
            rec.scalar(&tag(&format!("expert_{e}")), *t)?;
        }
    }
    Ok(())
}

impl Hooks for Recorded<'_> {
    fn batch(&mut self, cx: &mut Context, step: u64) -> Result<Batch> {
        self.hooks.batch(cx, step)
    }

    fn evaluate(&mut self, cx: &mut Context, steps: u64) -> Result<Option<f64>> {
        let metric = self.hooks.evaluate(cx, steps)?;
        let parts = self.hooks.metric_parts();
        if let Some(rec) = self.rec.as_mut() {
            rec.set_count(steps);
            for (name, v) in &parts {
                rec.scalar(&format!("{METRIC_PART_PREFIX}{name}"), *v)?;
            }
        }
        Ok(metric)
    }

    fn metric_parts(&mut self) -> Vec<(String, f64)> {
        self.hooks.metric_parts()
    }

    fn after_step(&mut self, cx: &mut Context, done: &StepDone) -> Result<()> {
        self.hooks.after_step(cx, done)?;
        let loads = cx.engine()?.expert_loads().to_vec();
        self.record(done, &loads)
    }

    fn checkpoint(&mut self, cx: &mut Context, steps: u64, background: bool) -> Result<()> {
        if let Some(rec) = self.rec.as_mut() {
            rec.flush()?;
        }
        self.hooks.checkpoint(cx, steps, background)
    }

    fn stop_requested(&self) -> bool {
        self.hooks.stop_requested()
    }
}
