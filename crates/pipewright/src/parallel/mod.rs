//! How a model is split over ranks, one axis per module: tensor parallelism (TorchShard's
//! split layers), context parallelism (sequences over a ring), data parallelism (bucketed
//! gradient sums, the distributed loader, the sums started during the backward), expert parallelism (a mixture's experts split over
//! data-parallel ranks, tokens exchanged all-to-all), ZeRO (sharded optimizer state, gradients and
//! weights), the pipeline (partitions, schedules as data, one rank's executor), and the loss,
//! which reduces over whichever of these groups hold parts of the output.
//!
//! It builds on [`crate::model`] (layers) and [`crate::distributed`] (communicators, the layout);
//! the engine ([`crate::engine`]) composes these axes into one training step.

pub mod context_parallel;
pub mod data_parallel;
pub mod dims;
pub mod expert_parallel;
pub mod loss;
pub mod overlap;
pub mod pipeline;
pub mod tensor_parallel;
pub mod zero;
