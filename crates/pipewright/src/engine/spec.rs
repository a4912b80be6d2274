//! A training run as data: the layout, the batch and its micro-batches, the pipeline schedule,
//! precision and recompute, the optimizer and its learning rate, the seed and the cadence. A
//! [`TrainSpec`] serializes (a run directory's `params.json` and a checkpoint record it), is
//! borrowed whole by the step ([`crate::engine::varuna::VarunaOptions::spec`]), builds the
//! optimizer it describes, and morphs into a world of another size.
//! It leaves out the model and the data, which are the program's: `pipewright-models`'
//! `RunSpec` adds its reference models and tasks; a user's program adds its own beside it.

use candle_core::Var;
use serde::{Deserialize, Serialize};

use crate::distributed::topology::Layout;
use crate::model::batch::Batch;
use crate::model::nn::optim::{LrSchedule, Optimizer, OptimizerConfig};
use crate::model::precision::Precision;
use crate::model::{Build, Sequential};
use crate::parallel::data_parallel::DEFAULT_BUCKET_BYTES;
use crate::parallel::pipeline::schedule::{Schedule, ScheduleKind};
use crate::parallel::pipeline::Recompute;
use crate::parallel::zero::Zero;
use crate::plan::{balance_by, morph, By, Morph, MorphPlanner, MorphRequest};
use crate::{invalid, Error, Result};

/// How layers are split over the model stages (serialized as `{"layers": [3, 2]}`, `"time"`
/// or `"size"`; parsed from `3,2`, `time` (or `auto`) and `size`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Balance {
    /// Layers (or segments between cut points) per model stage.
    Layers(Vec<usize>),
    /// Profiled on one micro-batch: the split whose slowest stage is least.
    Time,
    /// Profiled on one micro-batch: the split whose largest stage is least.
    Size,
}

impl std::str::FromStr for Balance {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.trim() {
            "time" | "auto" => Self::Time,
            "size" => Self::Size,
            list => Self::Layers(
                list.split(',')
                    .map(|n| n.trim().parse::<usize>())
                    .collect::<std::result::Result<_, _>>()
                    .map_err(|_| {
                        invalid!("balance `{list}`: give layers per stage (3,2), time or size")
                    })?,
            ),
        })
    }
}

/// Everything a training run is besides its model and its data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainSpec {
    /// Pipeline stages, tensor-parallel shards and data-parallel replicas.
    pub layout: Layout,
    /// Rows of every step over all replicas.
    pub global_batch: usize,
    /// Rows of one micro-batch (Varuna's `chunk_size`).
    pub micro_batch: usize,
    /// The pipeline schedule.
    pub schedule: ScheduleKind,
    /// Model stages per pipeline rank (interleaved schedule).
    pub virtual_stages: usize,
    /// A schedule given as data (`--schedule-file`: saved by `pipewright schedule --save`,
    /// edited or written by hand, or dumped by PyTorch): when set, it replaces `schedule` and
    /// `virtual_stages`. Recorded as its text; runs recorded before it had none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom_schedule: Option<Schedule>,
    /// What the model computes in.
    pub precision: Precision,
    /// Activation recomputation.
    pub recompute: Recompute,
    /// How layers are split over stages; uniform when `None`.
    pub balance: Option<Balance>,
    /// BatchNorm statistics move once per batch.
    pub deferred_batch_norm: bool,
    /// The optimizer and its hyper-parameters.
    pub optimizer: OptimizerConfig,
    /// The learning rate by step.
    pub lr: LrSchedule,
    /// Clip the global gradient norm to this.
    pub clip: Option<f64>,
    /// What the data-parallel replicas shard (ZeRO); runs recorded before it had none.
    #[serde(default)]
    pub zero: Zero,
    /// Megatron's sequence parallelism over the tensor-parallel ranks (see
    /// [`crate::parallel::tensor_parallel`]); runs recorded before it had none.
    #[serde(default)]
    pub sequence_parallel: bool,
    /// Data-parallel gradient sums start during the backward, as each layer's gradients are
    /// final (PyTorch DDP's default), and ZeRO-2/3's reduce-scatters travel while the pipeline
    /// goes on; `false` (`--no-overlap`) sums after the schedule ends and waits for each
    /// reduce-scatter at once, for comparison and debugging. The same bits either way. Runs
    /// recorded before it overlapped nothing.
    #[serde(default)]
    pub overlap: bool,
    /// Bytes per bucket of the gradient sums over the replicas and of ZeRO's shards (PyTorch
    /// DDP's `bucket_cap_mb`, 25 MiB; `train --bucket-mb`): smaller buckets start their sums
    /// sooner in the backward, larger ones make fewer collectives. The same bits at any size.
    #[serde(default = "default_bucket_bytes")]
    pub bucket_bytes: usize,
    /// ZeRO-3's gathered layers at most at a time, the one computing included (`train
    /// --zero-live-layers`, DeepSpeed's `stage3_max_live_parameters` by layer): above 1, the
    /// next layers' gathers start while one computes (FSDP's prefetch); 1 gathers each layer
    /// when it is needed, as does overlap off. The same bits at any bound.
    #[serde(default = "default_live_layers")]
    pub zero_live_layers: usize,
    /// Seeds initialisation, dropout, the data and everything random.
    pub seed: u64,
    /// How long the run trains and when it evaluates, logs and saves.
    pub cadence: Cadence,
}

/// DDP's 25 MiB, for runs recorded before the bucket was theirs to set.
fn default_bucket_bytes() -> usize {
    DEFAULT_BUCKET_BYTES
}

/// Two gathered layers: the one computing and the next (runs recorded before prefetch held one).
fn default_live_layers() -> usize {
    2
}

impl TrainSpec {
    /// `steps` steps of `layout` on `global_batch` rows in micro-batches of `micro_batch`:
    /// f32, 1F1B, AdamW at a constant 1e-3, no clipping, no ZeRO, one evaluation at the end.
    pub fn new(layout: Layout, global_batch: usize, micro_batch: usize, steps: u64) -> Self {
        Self {
            layout,
            global_batch,
            micro_batch,
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            custom_schedule: None,
            precision: Precision::F32,
            recompute: Recompute::Never,
            balance: None,
            deferred_batch_norm: false,
            optimizer: OptimizerConfig::default(),
            lr: LrSchedule::Constant { lr: 1e-3 },
            clip: None,
            zero: Zero::Off,
            sequence_parallel: false,
            overlap: true,
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            zero_live_layers: default_live_layers(),
            seed: 0,
            cadence: Cadence::steps(steps),
        }
    }

    /// Whether the data-parallel gradient sums start during the backward: overlap on, more
    /// than one replica, and gradients whole (ZeRO-2 and 3 reduce-scatter each micro-batch's
    /// as the pipeline completes them already).
    pub fn overlaps_grad_sums(&self) -> bool {
        self.overlap && self.layout.dp > 1 && !self.zero.shards_grads()
    }

    /// Whether the last micro-batch's forward is cut into one graph per layer, so that its
    /// backward gives each layer's gradients as they are final: overlap on with more than one
    /// replica (ZeRO-3 cuts every micro-batch's anyway).
    pub fn cuts_last_forward(&self) -> bool {
        self.overlap && self.layout.dp > 1
    }

    /// ZeRO-3's gathered layers at most at a time: [`TrainSpec::zero_live_layers`], or 1
    /// (each layer gathered when it is needed) with overlap off.
    pub fn live_layers(&self) -> usize {
        if self.overlap {
            self.zero_live_layers
        } else {
            1
        }
    }

    /// Ranks the run needs.
    pub fn world(&self) -> usize {
        self.layout.world()
    }

    /// Micro-batches each data-parallel replica splits its rows into
    /// ([`Layout::micro_batches`], the one check that a batch splits).
    pub fn micro_batches(&self) -> Result<usize> {
        self.layout
            .micro_batches(self.global_batch, self.micro_batch)
    }

    /// The schedule the pipeline runs: the given one (checked to fit the pipeline's ranks and
    /// micro-batches, complete and deadlock-free), else the built `schedule`.
    pub fn schedule(&self) -> Result<Schedule> {
        let s = Schedule::for_pipeline(
            self.custom_schedule.as_ref(),
            self.schedule,
            self.virtual_stages,
            self.layout.pp,
            self.micro_batches()?,
        )?;
        if self.custom_schedule.is_some() {
            s.validate()?;
        }
        Ok(s)
    }

    /// How the run is split, as a console line's tail (empty for one rank): `, pipeline pp=2
    /// 1f1b virtual=1, tensor-parallel tp=2 with sequence parallelism, data-parallel dp=2
    /// ZeRO-2, ...`; a given schedule is named by `schedule_file`, where it was read from.
    pub fn describe_parallelism(&self, schedule_file: Option<&std::path::Path>) -> String {
        let (l, mut out) = (self.layout, String::new());
        if l.pp > 1 {
            let schedule = match schedule_file {
                Some(f) if self.custom_schedule.is_some() => format!("schedule {}", f.display()),
                _ => format!("{} virtual={}", self.schedule, self.virtual_stages),
            };
            out += &format!(", pipeline pp={} {schedule}", l.pp);
        }
        if l.tp > 1 {
            out += &format!(", tensor-parallel tp={}", l.tp);
            if self.sequence_parallel {
                out += " with sequence parallelism";
            }
        }
        if l.cp > 1 {
            out += &format!(", context-parallel cp={}", l.cp);
        }
        if l.dp > 1 {
            out += &format!(", data-parallel dp={}", l.dp);
            if self.zero != Zero::Off {
                out += &format!(" ZeRO-{}", self.zero.number());
            }
        }
        if l.ep > 1 {
            out += &format!(", expert-parallel ep={}", l.ep);
        }
        out
    }

    /// Fails on a spec that cannot run whatever the model: a batch that does not split into
    /// the replicas' micro-batches, a negative clip, a cadence without periods.
    pub fn validate(&self) -> Result<()> {
        self.cadence.validate()?;
        if let Some(c) = self.clip {
            if c <= 0.0 || !c.is_finite() {
                return Err(invalid!("clip must be a positive norm (or none), got {c}"));
            }
        }
        self.micro_batches().map(|_| ())
    }

    /// This spec with its balance as layers per stage (what the step runs): the given list,
    /// or profiled here (on the CPU, seeded) on `sample`, one micro-batch, for
    /// [`Balance::Time`] and [`Balance::Size`]. Ranks that profile each take one rank's
    /// result (the trainer broadcasts rank 0's), or their stages would not meet.
    pub fn resolve_balance(&self, model: &Sequential, sample: &Batch) -> Result<Self> {
        let by = match &self.balance {
            None | Some(Balance::Layers(_)) => return Ok(self.clone()),
            Some(Balance::Time) => By::Time,
            Some(Balance::Size) => By::Size,
        };
        let placement = self.schedule()?.placement()?;
        let layers = balance_by(by, model, &Build::cpu(self.seed), sample, &placement)?;
        Ok(Self {
            balance: Some(Balance::Layers(layers)),
            ..self.clone()
        })
    }

    /// The optimizer over `params` (for [`crate::engine::varuna::Varuna::set_optimizer`]) of a model
    /// whose tied pairs are `tied`.
    pub fn optimizer(
        &self,
        params: Vec<(String, Var)>,
        tied: &[(String, String)],
    ) -> Result<Box<dyn Optimizer>> {
        self.optimizer.build(params, tied)
    }

    /// The spec of this run restarted in a world of `world` ranks (Varuna's morphing): the
    /// layout [`morph()`] chooses for `model` (a tensor-parallel size must divide every one of
    /// `tp_divides`; `planner` picks the fastest, else the nearest layout is taken), the same
    /// batch, micro-batch, schedule and recompute mode, an explicit list of layers per stage
    /// dropped (it was made for the old pipeline), a given schedule dropped for the built one
    /// when the pipeline's ranks or micro-batches change, and why that layout.
    pub fn morph(
        &self,
        world: usize,
        model: &Sequential,
        tp_divides: Vec<usize>,
        planner: Option<MorphPlanner>,
    ) -> Result<(Self, Morph)> {
        let req = MorphRequest {
            world,
            from: self.layout,
            global_batch: self.global_batch,
            micro_batch: self.micro_batch,
            schedule: self.schedule,
            virtual_stages: self.virtual_stages,
            recompute: self.recompute,
            zero: self.zero,
            tp_divides,
        };
        let m = morph(&req, model, planner)?;
        let mut spec = self.clone();
        spec.layout = m.layout;
        if matches!(spec.balance, Some(Balance::Layers(_))) {
            spec.balance = None;
        }
        // A given schedule has the old pipeline's ranks and micro-batches.
        if spec.layout.pp != self.layout.pp || spec.micro_batches()? != self.micro_batches()? {
            spec.custom_schedule = None;
        }
        Ok((spec, m))
    }
}

/// How long a run trains and when it evaluates, logs and saves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cadence {
    /// Steps of the whole run (a resumed run takes only those it has not taken).
    pub steps: u64,
    /// Evaluate after every `eval_every` steps, and after the last.
    pub eval_every: u64,
    /// Save after every `checkpoint_every` steps (0: never; a stop request saves anyway).
    pub checkpoint_every: u64,
    /// Mark every `log_every`-th step for logging (evaluations are always marked).
    pub log_every: u64,
    /// Write checkpoints in the background while training goes on (the last is finished
    /// before the trainer's `fit` returns).
    pub async_checkpoint: bool,
}

impl Cadence {
    /// `steps` steps, one evaluation at the end, every step logged, no checkpoint.
    pub fn steps(steps: u64) -> Self {
        Self {
            steps,
            eval_every: steps.max(1),
            checkpoint_every: 0,
            log_every: 1,
            async_checkpoint: false,
        }
    }

    /// Fails on a cadence that cannot run (no evaluation or log period).
    pub fn validate(&self) -> Result<()> {
        if self.eval_every == 0 || self.log_every == 0 {
            return Err(invalid!(
                "eval_every and log_every must be at least 1 (got {} and {})",
                self.eval_every,
                self.log_every
            ));
        }
        Ok(())
    }
}
