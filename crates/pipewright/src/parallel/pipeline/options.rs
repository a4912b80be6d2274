//! [`PipelineOptions`]: how a pipeline splits its model and batch and which schedule it runs.

use super::recompute::Recompute;
use super::schedule::{Schedule, ScheduleKind};

/// How to split and schedule.
#[derive(Clone, Debug)]
pub struct PipelineOptions {
    /// Micro-batches per batch (torchgpipe's `chunks`, torch.distributed.pipelining's
    /// `n_microbatches`).
    pub micro_batches: usize,
    /// The built schedule to run.
    pub schedule: ScheduleKind,
    /// Model stages per rank (interleaved schedule).
    pub virtual_stages: usize,
    /// A schedule given as data (written by hand or loaded with [`Schedule::load`]): when
    /// set, it replaces `schedule` and `virtual_stages`.
    pub custom_schedule: Option<Schedule>,
    /// Layers (or segments between cut points) per model stage; uniform if `None`.
    pub balance: Option<Vec<usize>>,
    /// Seeds dropout (with the step and micro-batch).
    pub seed: u64,
    /// Parameter pairs kept equal across stages (GPT's `wte.weight`, `lm_head.weight`).
    pub tied: Vec<(String, String)>,
    /// Which micro-batches drop their activations and recompute them in the backward.
    pub recompute: Recompute,
    /// Deferred batch norm: running statistics move once per batch, over all micro-batches.
    pub deferred_batch_norm: bool,
    /// Check every layer's output for NaN and inf (see `VarunaOptions::detect_anomaly`).
    pub detect_anomaly: bool,
    /// Cut the last micro-batch's forward into one graph per layer, so that its backward gives
    /// each layer's gradients as soon as they are final and their sums over the replicas start
    /// while the layers before still compute ([`crate::parallel::overlap`]).
    pub cut_last: bool,
}
