//! A run in flag form: [`TrainArgs`], every flag of `pipewright train` (and of `plan`,
//! `profile` and `ckpt`, which describe a run the same way), and the one way flags become a
//! [`RunSpec`](crate::RunSpec) ([`TrainArgs::spec`]): the model's defaults and its parallel
//! rules checked against the layout (heads and vocabulary over tp, sequences over cp and
//! sequence parallelism), the task, and everything else through
//! [`TrainArgs::train_spec`]. The flags come in the sections a run is described by: the
//! library's own where a flag is the field (`Layout`, `PipelineSpec`, `Cadence`), else the
//! program's ([`ParallelArgs`], [`OptimArgs`], [`BatchArgs`], [`CheckpointArgs`],
//! [`OutputArgs`], [`ModelArgs`], [`TaskArgs`]), each building the library's section of its
//! name; `params.json` holds them flat, typed values as the text they are given in
//! ([`unused_by_plan`] and [`unused_by_profile`] say which `plan` and `profile` ignore). A program
//! of its own declares the same flags with `Experiment::args::<TrainArgs>()` and reads them
//! with `Params::args`.

mod args;
mod as_text;
mod checks;
mod inherit;
mod model;
mod moe;
mod sections;
mod spec;
mod unused;

pub use args::{
    finite, positive, positive_u64, DecayKind, LrScheduleKind, ModelKind, OptimizerKind, TaskKind,
    TrainArgs,
};
pub use inherit::inherit_checkpointing;
pub use sections::{
    BatchArgs, CheckpointArgs, ModelArgs, OptimArgs, OutputArgs, ParallelArgs, TaskArgs,
};
pub use spec::{blend_of, task_spec};
pub use unused::{unused_by_plan, unused_by_profile};
