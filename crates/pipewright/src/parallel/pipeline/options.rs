//! [`PipelineOptions`]: how a pipeline splits its model and batch and which schedule it runs.

use super::spec::PipelineSpec;

/// How to split and schedule: the run's pipeline section and what one step adds to it.
#[derive(Clone, Debug)]
pub struct PipelineOptions {
    /// The schedule, balance (layers per stage, resolved), recompute mode and deferred batch
    /// norm of the run.
    pub spec: PipelineSpec,
    /// Micro-batches per batch (torchgpipe's `chunks`, torch.distributed.pipelining's
    /// `n_microbatches`).
    pub micro_batches: usize,
    /// Seeds dropout (with the step and micro-batch).
    pub seed: u64,
    /// Parameter pairs kept equal across stages (GPT's `wte.weight`, `lm_head.weight`).
    pub tied: Vec<(String, String)>,
    /// Check every layer's output for NaN and inf (see `VarunaOptions::detect_anomaly`).
    pub detect_anomaly: bool,
    /// Cut the last micro-batch's forward into one graph per layer, so that its backward gives
    /// each layer's gradients as soon as they are final and their sums over the replicas start
    /// while the layers before still compute ([`crate::parallel::overlap`]).
    pub cut_last: bool,
}
