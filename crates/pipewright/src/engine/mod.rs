//! One rank's training step and its state: [`varuna::Varuna`] (the step over any
//! pp x tp x cp x dp layout, on any device), [`serial::SerialTrainer`] (single-device training,
//! the oracle every layout must reproduce) and layout-free [`checkpoint`]s.
//!
//! It composes [`crate::parallel`]'s axes and [`crate::plan`]'s partitions; the trainer
//! ([`crate::trainer`]) drives it through a whole run.

pub mod checkpoint;
pub mod serial;
pub mod spec;
pub mod varuna;
