//! What a [`super::Varuna`] is made with and what its calls return.

use std::sync::Arc;

use candle_core::{Device, Tensor};

use crate::distributed::topology::{Layout, Topology};
use crate::engine::spec::TrainSpec;
use crate::model::batch::Batch;
use crate::model::precision::LossScaler;
use crate::model::Sequential;
use crate::parallel::loss::{CrossEntropy, SharedLoss};
use crate::parallel::pipeline::partition::partition;
use crate::parallel::pipeline::PipelineOptions;
use crate::{invalid, Result};

/// The rows `rows` of the global batch of step `step` (counted from 0): a pure function of the
/// step, so that every replica, layout and resumed run reads the same rows. The one batch
/// function of the library: a run's data ([`crate::trainer::Run`]) and the sample batch
/// [`VarunaOptions::batch_fn`] checks shapes with (Varuna's `get_batch_fn`) alike.
pub type Data = Arc<dyn Fn(u64, usize) -> Result<Batch> + Send + Sync>;

/// Everything [`super::Varuna::new`] needs besides the model and the world: the run's
/// [`TrainSpec`] (its layout, batch, schedule, precision, recompute, ZeRO, clipping, learning
/// rate and seed; the optimizer and the cadence in it are the trainer's, not the step's) and
/// what only a running program has (tied pairs, placement, loss, device, ...).
#[derive(Clone)]
pub struct VarunaOptions {
    /// The run this step belongs to. Its balance, when given, is layers per stage
    /// ([`Balance::Layers`](crate::parallel::pipeline::Balance::Layers); a profiled balance is resolved before, the same on every rank:
    /// [`TrainSpec::resolve_balance`]).
    pub spec: TrainSpec,
    /// Varuna's `stage_to_rank_map` (`"0,1;2,3;"`: stage 0 on ranks 0 and 1, ...), with
    /// `spec.parallel.layout.tp` consecutive ranks per shard group; the layout's order (tp fastest,
    /// see [`crate::distributed::topology`]) when `None`. Its layout must be the spec's.
    pub stage_to_rank_map: Option<String>,
    /// Parameter pairs kept equal (Varuna's `shared_weights`).
    pub shared_weights: Vec<(String, String)>,
    /// When given, step 0's first `micro_batch` rows are run through the model (evaluation
    /// mode) at construction, so that a shape error shows before training.
    pub batch_fn: Option<Data>,
    /// After every layer's forward, check its output and fail at the first NaN or inf,
    /// naming the layer, micro-batch and step (PyTorch's anomaly detection; costs a
    /// reduction per layer: for debugging).
    pub detect_anomaly: bool,
    /// Used with f16 only.
    pub loss_scaler: LossScaler,
    /// The objective, computed on the last stage (Varuna's model returns its loss; here the
    /// loss is given apart, see [`crate::parallel::loss`]). Cross-entropy against
    /// [`Batch::TARGETS`] by default.
    pub loss: SharedLoss,
    /// Where this rank computes (Varuna's `device=local_rank`): every parameter, activation
    /// and gradient of the rank lives there.
    pub device: Device,
}

impl VarunaOptions {
    /// The step of `spec`: no tied weights, the layout's placement, PyTorch's loss scaler,
    /// cross-entropy, the CPU.
    pub fn of(spec: TrainSpec) -> Self {
        Self {
            spec,
            stage_to_rank_map: None,
            shared_weights: Vec::new(),
            batch_fn: None,
            detect_anomaly: false,
            loss_scaler: LossScaler::new(),
            loss: Arc::new(CrossEntropy::default()),
            device: Device::Cpu,
        }
    }

    /// [`VarunaOptions::of`] [`TrainSpec::new`]: f32, 1F1B, no clipping, constant lr 1e-3, no
    /// ZeRO, seed 0.
    pub fn new(layout: Layout, global_batch: usize, micro_batch: usize) -> Self {
        Self::of(TrainSpec::new(layout, global_batch, micro_batch, 1))
    }

    /// These options with their spec changed by `change` (a program or test that varies one
    /// field of the run: `opts.with_spec(|s| s.precision = Precision::Bf16)`).
    pub fn with_spec(mut self, change: impl FnOnce(&mut TrainSpec)) -> Self {
        change(&mut self.spec);
        self
    }

    /// Where ranks go: the spec's layout in its order, or the stage-to-rank map (which must
    /// describe the same layout).
    pub fn topology(&self) -> Result<Topology> {
        let layout = self.spec.layout();
        let Some(map) = &self.stage_to_rank_map else {
            return Ok(Topology::new(layout));
        };
        // A map places stages and replicas; the experts split over the replicas it places.
        let topo = Topology::from_stage_to_rank_map(map, layout.tp)?.with_ep(layout.ep)?;
        if topo.layout() != layout {
            return Err(invalid!(
                "the stage-to-rank map `{map}` places {:?}, but the spec's layout is {layout:?}: \
                 give a map of the spec's layout (or the spec the map's)",
                topo.layout()
            ));
        }
        Ok(topo)
    }

    /// What the pipeline runs of this step: the spec's micro-batches, schedule, balance,
    /// recompute and seed with the tied pairs and the program's options.
    pub fn pipeline_options(&self) -> Result<PipelineOptions> {
        let s = &self.spec;
        Ok(PipelineOptions {
            spec: s.pipeline.clone(),
            micro_batches: s.micro_batches()?,
            seed: s.seed,
            tied: self.shared_weights.clone(),
            detect_anomaly: self.detect_anomaly,
            cut_last: s.cuts_last_forward(),
        })
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
        let schedule = self.spec.schedule()?;
        partition(model, schedule.stages, self.spec.pipeline.layers()?)?;
        model.skips()?;
        self.spec.optim.lr.validate()
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
