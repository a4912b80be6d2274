//! One point of the planner's search: a layout and how its batch is cut and scheduled.

use std::fmt;

use serde::Serialize;

use crate::distributed::topology::Layout;
use crate::parallel::dims::ParallelSpec;
use crate::parallel::pipeline::ScheduleChoice;

/// One point of the search: a layout and how its batch is cut and scheduled.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Candidate {
    /// The layout, ZeRO stage and sequence parallelism (a run's parallel section).
    #[serde(flatten)]
    pub parallel: ParallelSpec,
    /// Rows of one micro-batch.
    pub micro_batch: usize,
    /// Micro-batches per data-parallel replica (`chunks`).
    pub micro_batches: usize,
    /// The pipeline schedule, its stages per rank and the recompute mode.
    #[serde(flatten)]
    pub schedule: ScheduleChoice,
}

impl fmt::Display for Candidate {
    /// `pp=2 tp=1 dp=2 mbs 32 interleaved v2` (`sp` after the layout with sequence
    /// parallelism): how a plan names a candidate it cannot run.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let sp = if self.parallel.sequence_parallel {
            " sp"
        } else {
            ""
        };
        write!(
            f,
            "{}{sp} mbs {} {}",
            self.parallel.layout, self.micro_batch, self.schedule
        )
    }
}

impl Candidate {
    /// The layout (the parallel section's).
    pub fn layout(&self) -> Layout {
        self.parallel.layout
    }
}
