//! Pipeline parallelism: which layers each stage owns ([`partition`]), micro-batches
//! ([`microbatch`]), and schedules as data ([`schedule`]): per-stage action lists that drive the
//! executor, the simulator, the validator and the timeline picture alike.

pub mod executor;
pub mod microbatch;
pub mod partition;
pub mod schedule;
