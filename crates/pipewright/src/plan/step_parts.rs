//! Where a training step's time goes, part by part: what [`crate::engine::varuna::Varuna::step`]
//! measures on each rank, and what [`super::estimate()`] predicts for the same parts, so
//! that a prediction that misses can be checked part by part instead of as one number.
//!
//! The parts, in the order a step runs them:
//! - **pipeline**: the schedule over the replica's micro-batches (forwards, backwards, sends;
//!   ZeRO-2/3's per-micro-batch collectives), bubble included;
//! - **gradients**: the produced gradients made f32 masters' gradients and summed over the
//!   replicas (the data-parallel all-reduce, or ZeRO's reduce-scatter finishing); with the sums
//!   started during the backward ([`crate::parallel::overlap`]), what of them is left after the
//!   pipeline: the communication the step exposes;
//! - **scalars**: the step's scalar all-reduces (the counted targets and the loss over the
//!   replicas, the overflow flag over the world). These are where a rank waits for the
//!   slowest rank of the world, so on the ranks that finish first they hold that wait;
//! - **update**: the overflow check, the global gradient norm (itself a scalar all-reduce over
//!   the pipeline and tensor-parallel group), clipping, the optimizer and the weights'
//!   publication (ZeRO's all-gather), buffers following replica 0.
//!
//! A rank's step time is its parts' sum and the time `step` spends before the first part
//! (checking and cutting the batch: microseconds). Beside the parts, the step's **exposed
//! communication** ([`StepParts::exposed_comm_s`]): of the pipeline and gradients parts, the
//! time the rank waited on data-parallel communication (gradient sums, ZeRO's reduce-scatters
//! and gathers), which overlap hides and `--no-overlap` shows whole.

use std::fmt;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use super::layer_cost::median;

/// Seconds of each part of one step (or of a median step, part by part).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepParts {
    /// The pipeline schedule, bubble included.
    pub pipeline_s: f64,
    /// The gradients made f32 and summed over the replicas (with overlap, the wait for what
    /// was still in flight after the pipeline: the exposed communication).
    pub gradients_s: f64,
    /// The scalar all-reduces, with their waits for the slowest rank.
    pub scalars_s: f64,
    /// Norm, clipping, optimizer and the weights' publication.
    pub update_s: f64,
    /// Of the pipeline and gradients parts, the time waited on data-parallel communication
    /// (the gradient sums, ZeRO's reduce-scatters and gathers: starts and waits,
    /// [`crate::distributed::comm::waited`]): the communication the step exposes. Not a part of its
    /// own (the parts' total leaves it out); zero in runs recorded before it was measured.
    #[serde(default)]
    pub exposed_comm_s: f64,
}

/// One part of a step, for [`PartClock::lap`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// See [`StepParts::pipeline_s`].
    Pipeline,
    /// See [`StepParts::gradients_s`].
    Gradients,
    /// See [`StepParts::scalars_s`].
    Scalars,
    /// See [`StepParts::update_s`].
    Update,
}

impl StepParts {
    /// The parts' sum.
    pub fn total(&self) -> f64 {
        self.pipeline_s + self.gradients_s + self.scalars_s + self.update_s
    }

    /// Rank 0's parts of a predicted step of `step_s` seconds, as rank 0 times them: its own
    /// gradient sum and update, the step's scalar all-reduces with the wait in the overflow
    /// flag's for the slowest rank's gradient sum (`slowest_gradients_s`), and the pipeline
    /// the rest (where rank 0 waits, in its next schedule, for a longer update elsewhere); its
    /// exposed communication the gradients part (what of the sums the step waits for).
    pub fn of_rank_zero(
        step_s: f64,
        gradients_s: f64,
        update_s: f64,
        scalars_s: f64,
        slowest_gradients_s: f64,
    ) -> StepParts {
        let scalars_s = scalars_s + (slowest_gradients_s - gradients_s).max(0.0);
        StepParts {
            pipeline_s: step_s - gradients_s - scalars_s - update_s,
            gradients_s,
            scalars_s,
            update_s,
            exposed_comm_s: gradients_s,
        }
    }

    /// Each part's median over `steps` (each part on its own: the result is not one of the
    /// steps, and its total need not be the median step's). All zero for no steps.
    pub fn median_of(steps: &[StepParts]) -> StepParts {
        if steps.is_empty() {
            return StepParts::default();
        }
        let of = |f: fn(&StepParts) -> f64| median(steps.iter().map(f).collect());
        StepParts {
            pipeline_s: of(|p| p.pipeline_s),
            gradients_s: of(|p| p.gradients_s),
            scalars_s: of(|p| p.scalars_s),
            update_s: of(|p| p.update_s),
            exposed_comm_s: of(|p| p.exposed_comm_s),
        }
    }

    fn part_mut(&mut self, part: Part) -> &mut f64 {
        match part {
            Part::Pipeline => &mut self.pipeline_s,
            Part::Gradients => &mut self.gradients_s,
            Part::Scalars => &mut self.scalars_s,
            Part::Update => &mut self.update_s,
        }
    }
}

/// `pipeline 5.10 ms, gradients 0.42 ms, scalars 0.20 ms, update 0.51 ms`.
impl fmt::Display for StepParts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "pipeline {:.2} ms, gradients {:.2} ms, scalars {:.2} ms, update {:.2} ms",
            self.pipeline_s * 1e3,
            self.gradients_s * 1e3,
            self.scalars_s * 1e3,
            self.update_s * 1e3
        )
    }
}

/// A stopwatch over one step: each [`PartClock::lap`] adds the time since the previous lap
/// (or the start) to a part, so the parts account for every moment between the start and
/// the last lap once.
#[derive(Debug)]
pub struct PartClock {
    last: Instant,
    parts: StepParts,
}

impl PartClock {
    /// Starts the clock now, every part at zero.
    pub fn start() -> Self {
        Self {
            last: Instant::now(),
            parts: StepParts::default(),
        }
    }

    /// Adds the seconds since the previous lap to `part` and returns them.
    pub fn lap(&mut self, part: Part) -> f64 {
        let now = Instant::now();
        let seconds = now.duration_since(self.last).as_secs_f64();
        *self.parts.part_mut(part) += seconds;
        self.last = now;
        seconds
    }

    /// The parts so far.
    pub fn parts(&self) -> StepParts {
        self.parts
    }
}
