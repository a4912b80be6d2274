//! One point of the planner's search: a layout and how its batch is cut and scheduled.

use std::fmt;

use serde::Serialize;

use crate::distributed::topology::Layout;
use crate::parallel::dims::ParallelSpec;
use crate::parallel::pipeline::schedule::ScheduleKind;
use crate::parallel::pipeline::Recompute;

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
    /// The pipeline schedule.
    #[serde(serialize_with = "display")]
    pub schedule: ScheduleKind,
    /// Model stages per pipeline rank (interleaved).
    pub virtual_stages: usize,
    /// The recompute mode.
    #[serde(serialize_with = "display")]
    pub recompute: Recompute,
}

fn display<T: fmt::Display, S: serde::Serializer>(
    v: &T,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.collect_str(v)
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
            "{}{sp} mbs {} {} v{}",
            self.parallel.layout, self.micro_batch, self.schedule, self.virtual_stages
        )
    }
}

impl Candidate {
    /// The layout (the parallel section's).
    pub fn layout(&self) -> Layout {
        self.parallel.layout
    }
}
