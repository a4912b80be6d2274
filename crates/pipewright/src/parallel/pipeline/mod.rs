//! Pipeline parallelism: which layers each stage owns ([`partition`]), micro-batches
//! ([`microbatch`]), and schedules as data ([`schedule`]): per-rank action lists that drive the
//! executor, the simulator and validator ([`simulate`]) and the timeline pictures
//! ([`timeline`]) alike.
//!
//! The executor ([`executor::Pipeline`]) runs a rank's actions; what crosses a cut is in
//! [`transfer`], skip routing in [`skip`], tied weights in [`tied`], recomputation in
//! [`recompute`], evaluation in [`evaluate`] and traces in [`trace`].

mod action;
mod actions;
mod backward;
pub mod evaluate;
pub mod executor;
mod io;
pub mod microbatch;
mod options;
pub mod partition;
pub mod recompute;
pub mod schedule;
mod schedule_file;
pub mod schedule_v;
pub mod segments;
pub mod sharing;
pub mod simulate;
pub mod sink;
pub mod skip;
pub mod spec;
mod stage;
pub mod tied;
pub mod timeline;
pub mod trace;
pub mod trace_replay;
pub mod transfer;

pub use executor::{Pipeline, PipelineOptions};
pub use recompute::Recompute;
pub use schedule::{Action, Schedule, ScheduleKind};
pub use sharing::Sharing;
pub use sink::GradSink;
pub use spec::{Balance, PipelineSpec, ScheduleChoice};
pub use stage::PipelineStage;
pub use timeline::{Costs, Simulation, Span};
pub use trace::{chrome_trace, read_chrome_trace, CommEvent, TraceEvent};
pub use trace_replay::{replay_chrome_trace, TraceReplay};
