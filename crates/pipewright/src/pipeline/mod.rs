//! Pipeline parallelism: which layers each stage owns ([`partition`]), micro-batches
//! ([`microbatch`]), and schedules as data ([`schedule`]): per-stage action lists that drive the
//! executor, the simulator, the validator and the timeline picture alike.
//!
//! The executor ([`executor::Pipeline`]) runs a rank's actions; what crosses a cut is in
//! [`transfer`], skip routing in [`skip`], tied weights in [`tied`], recomputation in
//! [`recompute`], evaluation in [`evaluate`] and traces in [`trace`].

mod backward;
pub mod evaluate;
pub mod executor;
mod io;
pub mod microbatch;
pub mod partition;
pub mod recompute;
mod replay;
pub mod schedule;
pub mod simulate;
pub mod skip;
pub mod tied;
pub mod trace;
pub mod transfer;

pub use executor::{Pipeline, PipelineOptions};
pub use recompute::Recompute;
pub use trace::{chrome_trace, read_chrome_trace, TraceEvent};
