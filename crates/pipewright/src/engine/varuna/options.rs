//! What a [`super::Varuna`] is made with and what its calls return.

use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::dist::topology::{Layout, Topology};
use crate::model::batch::Batch;
use crate::model::nn::optim::LrSchedule;
use crate::model::precision::{LossScaler, Precision};
use crate::model::Sequential;
use crate::parallel::data_parallel::DEFAULT_BUCKET_BYTES;
use crate::parallel::loss::{CrossEntropy, SharedLoss};
use crate::parallel::pipeline::partition::partition;
use crate::parallel::pipeline::schedule::{Schedule, ScheduleKind};
use crate::parallel::pipeline::Recompute;
use crate::parallel::zero::Zero;
use crate::Result;

/// Where ranks go.
#[derive(Clone, Debug)]
pub enum Placement {
    /// pp x tp x dp, tp fastest (see [`crate::dist::topology`]).
    Layout(Layout),
    /// Varuna's `stage_to_rank_map` (`"0,1;2,3;"`: stage 0 on ranks 0 and 1, ...) with `tp`
    /// consecutive ranks per shard group.
    StageToRankMap {
        /// Ranks of each stage.
        map: String,
        /// Ranks per shard group.
        tp: usize,
    },
}

/// A sample batch of a given number of rows (Varuna's `get_batch_fn`), to check shapes.
pub type BatchFn = Arc<dyn Fn(usize) -> Result<Batch> + Send + Sync>;

/// Everything [`super::Varuna::new`] needs besides the model and the world.
#[derive(Clone)]
pub struct VarunaOptions {
    /// Where ranks go.
    pub placement: Placement,
    /// Rows of one step over all replicas (Varuna's `global_batch_size`).
    pub global_batch: usize,
    /// Rows of one micro-batch (Varuna's `chunk_size`).
    pub micro_batch: usize,
    /// What the model computes in.
    pub precision: Precision,
    /// Parameter pairs kept equal (Varuna's `shared_weights`).
    pub shared_weights: Vec<(String, String)>,
    /// When given, a batch of `micro_batch` rows is run through the model (evaluation mode) at
    /// construction, so that a shape error shows before training.
    pub batch_fn: Option<BatchFn>,
    /// Seeds initialisation, dropout and everything random.
    pub seed: u64,
    /// The pipeline schedule.
    pub schedule: ScheduleKind,
    /// Model stages per pipeline rank (interleaved schedule).
    pub virtual_stages: usize,
    /// A schedule given as data (written by hand or loaded with [`Schedule::load`]): when
    /// set, it replaces `schedule` and `virtual_stages`.
    pub custom_schedule: Option<Schedule>,
    /// Layers (or segments between cut points) per model stage; uniform if `None`.
    pub balance: Option<Vec<usize>>,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// BatchNorm statistics move once per batch (torchgpipe's deferred batch norm).
    pub deferred_batch_norm: bool,
    /// After every layer's forward, check its output and fail at the first NaN or inf,
    /// naming the layer, micro-batch and step (PyTorch's anomaly detection; costs a
    /// reduction per layer: for debugging).
    pub detect_anomaly: bool,
    /// Clip the global gradient norm to this.
    pub clip: Option<f64>,
    /// The learning rate by step.
    pub lr: LrSchedule,
    /// Used with f16 only.
    pub loss_scaler: LossScaler,
    /// Bytes per gradient bucket summed over replicas (and per ZeRO bucket).
    pub bucket_bytes: usize,
    /// What the data-parallel replicas shard ([`crate::parallel::zero`]); nothing to shard with dp 1.
    pub zero: Zero,
    /// Megatron's sequence parallelism over the tensor-parallel group: activations outside
    /// the tensor-parallel layers (norms, residuals, dropout) split along the sequence instead
    /// of whole on every rank; exact against tp without it. No effect with tp 1.
    pub sequence_parallel: bool,
    /// The objective, computed on the last stage (Varuna's model returns its loss; here the
    /// loss is given apart, see [`crate::parallel::loss`]). Cross-entropy against
    /// [`Batch::TARGETS`] by default.
    pub loss: SharedLoss,
    /// Where this rank computes (Varuna's `device=local_rank`): every parameter, activation
    /// and gradient of the rank lives there.
    pub device: Device,
}

impl VarunaOptions {
    /// f32, 1F1B, no tied weights, no clipping, constant lr 1e-3, PyTorch's loss scaler,
    /// DDP's 25 MiB buckets, no ZeRO.
    pub fn new(layout: Layout, global_batch: usize, micro_batch: usize) -> Self {
        Self {
            placement: Placement::Layout(layout),
            global_batch,
            micro_batch,
            precision: Precision::F32,
            shared_weights: Vec::new(),
            batch_fn: None,
            seed: 0,
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            custom_schedule: None,
            balance: None,
            recompute: Recompute::Never,
            deferred_batch_norm: false,
            detect_anomaly: false,
            clip: None,
            lr: LrSchedule::Constant { lr: 1e-3 },
            loss_scaler: LossScaler::new(),
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            zero: Zero::Off,
            sequence_parallel: false,
            loss: Arc::new(CrossEntropy::default()),
            device: Device::Cpu,
        }
    }

    /// The layout the placement describes.
    pub fn topology(&self) -> Result<Topology> {
        match &self.placement {
            Placement::Layout(l) => Ok(Topology::new(*l)),
            Placement::StageToRankMap { map, tp } => Topology::from_stage_to_rank_map(map, *tp),
        }
    }

    /// Micro-batches each data-parallel replica splits its rows into
    /// ([`Layout::micro_batches`]).
    pub fn micro_batches(&self) -> Result<usize> {
        self.topology()?
            .layout()
            .micro_batches(self.global_batch, self.micro_batch)
    }

    /// Every check that builds nothing: the placement fits a world of `world` ranks, the
    /// global batch splits into replicas and micro-batches, the schedule exists for the
    /// pipeline, `model` splits into its stages (balance, cut points) with well-declared skip
    /// connections, the learning-rate schedule is valid. [`Varuna::new`] calls it; call it
    /// first to fail before creating anything.
    ///
    /// [`Varuna::new`]: super::Varuna::new
    pub fn validate(&self, model: &Sequential, world: usize) -> Result<()> {
        let topo = self.topology()?;
        topo.layout().check_world(world)?;
        let micro_batches = self.micro_batches()?;
        let pp = topo.layout().pp;
        let schedule = Schedule::for_pipeline(
            self.custom_schedule.as_ref(),
            self.schedule,
            self.virtual_stages,
            pp,
            micro_batches,
        )?;
        if self.custom_schedule.is_some() {
            schedule.validate()?;
        }
        partition(model, schedule.stages, self.balance.as_deref())?;
        model.skips()?;
        self.lr.validate()
    }
}

/// What one [`super::Varuna::step`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutcome {
    /// The step's number.
    pub step: u64,
    /// The global batch's mean loss (the same on every rank).
    pub loss: f64,
    /// Some rank found an inf or NaN gradient: every rank skipped the optimizer step.
    pub overflow: bool,
    /// Global gradient norm before clipping (NaN on an overflow).
    pub grad_norm: f64,
    /// The learning rate the step used.
    pub lr: f64,
    /// Loss scale used for this step (1 unless f16).
    pub loss_scale: f64,
    /// Counted targets of the global batch.
    pub targets: usize,
}

/// What [`super::Varuna::evaluate`] returns (the same on every rank).
#[derive(Clone, Debug)]
pub struct Evaluation {
    /// The batch's mean loss in evaluation mode.
    pub loss: f64,
    /// The count the loss averages over.
    pub count: usize,
    /// The last stage's output (f32, whole), when asked for.
    pub output: Option<Tensor>,
}
