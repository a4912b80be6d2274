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
use crate::model::nn::optim::{OptimSpec, Optimizer};
use crate::model::precision::Precision;
use crate::model::{Build, Sequential};
use crate::parallel::dims::{BatchSpec, ParallelSpec};
use crate::parallel::overlap::OverlapSpec;
use crate::parallel::pipeline::schedule::Schedule;
use crate::parallel::pipeline::PipelineSpec;
use crate::parallel::zero::Zero;
use crate::plan::{balance_by, morph, By, Morph, MorphPlanner, MorphRequest};
use crate::runtime::flag_values::positive_u64;
use crate::{invalid, Result};

pub use crate::parallel::pipeline::Balance;

/// Everything a training run is besides its model and its data: sections that own their
/// fields, serialized flat (a section's fields sit beside the others in `params.json` and in
/// a checkpoint's meta, as they did before there were sections).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainSpec {
    /// The layout, ZeRO and sequence parallelism.
    #[serde(flatten)]
    pub parallel: ParallelSpec,
    /// Rows of a step and of a micro-batch.
    #[serde(flatten)]
    pub batch: BatchSpec,
    /// The schedule, balance, recompute and deferred batch norm.
    #[serde(flatten)]
    pub pipeline: PipelineSpec,
    /// What the model computes in.
    pub precision: Precision,
    /// The optimizer, its learning rate and clipping.
    #[serde(flatten)]
    pub optim: OptimSpec,
    /// Whether communication overlaps computation, and its bucket and prefetch sizes.
    #[serde(flatten)]
    pub overlap: OverlapSpec,
    /// Seeds initialisation, dropout, the data and everything random.
    pub seed: u64,
    /// How long the run trains and when it evaluates, logs and saves.
    pub cadence: Cadence,
}

impl TrainSpec {
    /// `steps` steps of `layout` on `global_batch` rows in micro-batches of `micro_batch`:
    /// f32, 1F1B, AdamW at a constant 1e-3, no clipping, no ZeRO, one evaluation at the end.
    pub fn new(layout: Layout, global_batch: usize, micro_batch: usize, steps: u64) -> Self {
        Self {
            parallel: ParallelSpec::new(layout),
            batch: BatchSpec {
                global_batch,
                micro_batch,
            },
            pipeline: PipelineSpec::default(),
            precision: Precision::F32,
            optim: OptimSpec::default(),
            overlap: OverlapSpec::default(),
            seed: 0,
            cadence: Cadence::steps(steps),
        }
    }

    /// One rank, one row a step, one step, with [`TrainSpec::new`]'s defaults: what a serial
    /// oracle's options start from (`..TrainSpec::serial()`), which read only its seed,
    /// optimizer section and deferred batch norm.
    pub fn serial() -> Self {
        Self::new(Layout::serial(), 1, 1, 1)
    }

    /// The layout (the parallel section's).
    pub fn layout(&self) -> Layout {
        self.parallel.layout
    }

    /// Whether the data-parallel gradient sums start during the backward: overlap on, more
    /// than one replica, and gradients whole (ZeRO-2 and 3 reduce-scatter each micro-batch's
    /// as the pipeline completes them already).
    pub fn overlaps_grad_sums(&self) -> bool {
        self.cuts_last_forward() && !self.parallel.zero.shards_grads()
    }

    /// Whether the last micro-batch's forward is cut into one graph per layer, so that its
    /// backward gives each layer's gradients as they are final: overlap on with more than one
    /// replica (ZeRO-3 cuts every micro-batch's anyway).
    pub fn cuts_last_forward(&self) -> bool {
        self.overlap.overlap && self.parallel.layout.dp > 1
    }

    /// Ranks the run needs.
    pub fn world(&self) -> usize {
        self.parallel.world()
    }

    /// Micro-batches each data-parallel replica splits its rows into
    /// ([`Layout::micro_batches`], the one check that a batch splits).
    pub fn micro_batches(&self) -> Result<usize> {
        self.batch.micro_batches(&self.parallel.layout)
    }

    /// The schedule the pipeline runs: the given one (checked to fit the pipeline's ranks and
    /// micro-batches, complete and deadlock-free), else the built `schedule`.
    pub fn schedule(&self) -> Result<Schedule> {
        self.pipeline
            .schedule_for(self.parallel.layout.pp, self.micro_batches()?)
    }

    /// How the run is split, as a console line's tail (empty for one rank): `, pipeline pp=2
    /// 1f1b virtual=1, tensor-parallel tp=2 with sequence parallelism, data-parallel dp=2
    /// ZeRO-2, ...`; a given schedule is named by `schedule_file`, where it was read from.
    pub fn describe_parallelism(&self, schedule_file: Option<&std::path::Path>) -> String {
        let (l, p, mut out) = (self.parallel.layout, &self.pipeline, String::new());
        if l.pp > 1 {
            let schedule = match schedule_file {
                Some(f) if p.custom_schedule.is_some() => format!("schedule {}", f.display()),
                _ => format!("{} virtual={}", p.schedule.kind, p.schedule.virtual_stages),
            };
            out += &format!(", pipeline pp={} {schedule}", l.pp);
        }
        if l.tp > 1 {
            out += &format!(", tensor-parallel tp={}", l.tp);
            if self.parallel.sequence_parallel {
                out += " with sequence parallelism";
            }
        }
        if l.cp > 1 {
            out += &format!(", context-parallel cp={}", l.cp);
        }
        if l.dp > 1 {
            out += &format!(", data-parallel dp={}", l.dp);
            if self.parallel.zero != Zero::Off {
                out += &format!(" ZeRO-{}", self.parallel.zero.number());
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
        self.optim.validate()?;
        self.micro_batches().map(|_| ())
    }

    /// This spec with its balance as layers per stage (what the step runs): the given list,
    /// or profiled here (on the CPU, seeded) on `sample`, one micro-batch, for
    /// [`Balance::Time`] and [`Balance::Size`]. Ranks that profile each take one rank's
    /// result (the trainer broadcasts rank 0's), or their stages would not meet.
    pub fn resolve_balance(&self, model: &Sequential, sample: &Batch) -> Result<Self> {
        let by = match &self.pipeline.balance {
            None | Some(Balance::Layers(_)) => return Ok(self.clone()),
            Some(Balance::Time) => By::Time,
            Some(Balance::Size) => By::Size,
        };
        let placement = self.schedule()?.placement()?;
        let layers = balance_by(by, model, &Build::cpu(self.seed), sample, &placement)?;
        let mut spec = self.clone();
        spec.pipeline.balance = Some(Balance::Layers(layers));
        Ok(spec)
    }

    /// The optimizer over `params` (for [`crate::engine::varuna::Varuna::set_optimizer`]) of a model
    /// whose tied pairs are `tied`.
    pub fn optimizer(
        &self,
        params: Vec<(String, Var)>,
        tied: &[(String, String)],
    ) -> Result<Box<dyn Optimizer>> {
        self.optim.optimizer.build(params, tied)
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
            from: self.parallel,
            batch: self.batch,
            schedule: self.pipeline.schedule,
            tp_divides,
        };
        let m = morph(&req, model, planner)?;
        let mut spec = self.clone();
        spec.parallel.layout = m.layout;
        if matches!(spec.pipeline.balance, Some(Balance::Layers(_))) {
            spec.pipeline.balance = None;
        }
        // A given schedule has the old pipeline's ranks and micro-batches.
        if spec.parallel.layout.pp != self.parallel.layout.pp
            || spec.micro_batches()? != self.micro_batches()?
        {
            spec.pipeline.custom_schedule = None;
        }
        Ok((spec, m))
    }
}

/// How long a run trains and when it evaluates, logs and saves. Its fields are `train`'s
/// flags of the same names (clap's derive: a program flattens it into its own flags).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::Args)]
pub struct Cadence {
    /// Optimizer steps to train for (a resumed run counts the steps it already took).
    #[arg(help_heading = "Training", long, default_value_t = 1000, value_parser = positive_u64)]
    pub steps: u64,
    /// Evaluate the task's metric every K steps (and at the end).
    #[arg(help_heading = "Output", long, default_value_t = 250, value_parser = positive_u64)]
    pub eval_every: u64,
    /// Save a checkpoint every N steps (0: never; a stop request saves anyway).
    #[arg(help_heading = "Checkpoints", long, default_value_t = 0)]
    pub checkpoint_every: u64,
    /// Write one scalars row every K steps (evaluations are always logged).
    #[arg(help_heading = "Output", long, default_value_t = 1, value_parser = positive_u64)]
    pub log_every: u64,
    /// Write checkpoint files in a background thread while training goes on (the last is
    /// finished before the trainer's `fit` returns).
    #[arg(help_heading = "Checkpoints", long)]
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
