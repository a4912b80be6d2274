//! The Varuna step: one object that trains a model over any pipeline x tensor x data layout,
//! in f32, bf16 or f16, with the result of serial training.
//!
//! As Varuna's class: a model spec with cut points, a layout (or Varuna's
//! `stage_to_rank_map`), a batch function for shapes, the global batch size, the chunk
//! (micro-batch) size, the precision and the shared (tied) weights; then
//! [`Varuna::set_optimizer`], [`Varuna::step`] (returns the loss and whether the step
//! overflowed) and [`Varuna::evaluate`]. Every rank of the world makes one and calls `step`
//! with its replica's rows of the global batch
//! ([`crate::parallel::data_parallel::ReplicaBatches`] gives them).
//!
//! One step: the pipeline runs its schedule on the replica's micro-batches (losses divided by
//! the global batch's count of targets, times the loss scale); gradients become f32, are
//! summed over the replicas in buckets and unscaled; every rank learns whether any rank found
//! an inf or NaN, and all skip the step together if so; otherwise the global norm (each
//! parameter once, over stages and shards) clips them, the optimizer steps the f32 masters and
//! the masters are cast into the model.

mod checkpoint;
mod context_parallel;
mod describe;
mod generate;
mod measured;
mod options;
mod step;
mod zero;
mod zero_groups;

use candle_core::{Device, Tensor, Var};

pub use checkpoint::TrainState;
pub use generate::Sampling;
pub use options::{Data, Evaluation, StepOutcome, VarunaOptions};

use crate::distributed::comm::Group;
use crate::distributed::comm::{axis_group, waited, Communicator, ReduceOp};
use crate::distributed::topology::{Axis, Coords, Topology};
use crate::model::batch::Batch;
use crate::model::expert_load::ExpertLoad;
use crate::model::grads::Grads;
use crate::model::init::Init;
use crate::model::nn::optim::{scale_to_norm, Optimizer};
use crate::model::precision::{has_overflow, LossScaler, MasterWeights, Precision};
use crate::model::{Build, Sequential};
use crate::parallel::pipeline::{CommEvent, Pipeline, TraceEvent};
use crate::parallel::zero::Zero;
use crate::plan::{Part, PartClock, StepParts};
use crate::{invalid, Result};

type GradHook = Box<dyn FnMut(&mut Grads) + Send>;
type SummedHook = Box<dyn FnMut(&Grads) + Send>;

/// One rank of a pp x tp x dp training job.
pub struct Varuna {
    topo: Topology,
    coords: Coords,
    world: Box<dyn Communicator>,
    /// The ranks holding this rank's weights ([`Axis::Replica`]: data- and context-parallel),
    /// which sum their gradients, losses and target counts.
    dp: Box<dyn Communicator>,
    /// The context-parallel ring splitting this replica's sequences (a group of one: none).
    cp: Group,
    /// Under expert parallelism (ep > 1), the ranks holding this rank's experts
    /// ([`Axis::ExpertReplica`]), which sum the experts' gradients; without it the experts sum
    /// over `dp` with everything else.
    expert_dp: Option<Box<dyn Communicator>>,
    pipeline: Pipeline,
    /// The f32 masters the optimizer updates, whole or (ZeRO) this replica's pieces.
    weights: zero::Weights,
    optimizer: Option<Box<dyn Optimizer>>,
    opts: VarunaOptions,
    scaler: Option<LossScaler>,
    grad_hook: Option<GradHook>,
    summed_hook: Option<SummedHook>,
    /// Seconds of pipeline actions and of whole steps, for the bubble fraction.
    busy: f64,
    wall: f64,
    /// Each updating step's parts, as this rank timed them.
    parts: Vec<StepParts>,
    /// Executed pipeline actions, kept when [`Varuna::keep_trace`] asked for them.
    trace: Option<Vec<TraceEvent>>,
    /// The data-parallel communication beside them, kept likewise.
    comm_trace: Vec<CommEvent>,
    /// A checkpoint whose files are being written in the background.
    pending: Option<crate::engine::checkpoint::Pending>,
    /// The most rows [`Varuna::predict`] runs at once ([`Varuna::set_eval_rows`]).
    eval_rows: Option<usize>,
    /// Whether any rank's stages hold a mixture of experts (the same on every rank).
    mixtures: bool,
    /// What the mixtures routed in the last step, over the global batch.
    loads: Vec<ExpertLoad>,
}

impl Varuna {
    /// Builds this rank's stages and shards of `model` on `opts.device`; `world` spans every
    /// rank of the job.
    pub fn new(
        model: &Sequential,
        world: Box<dyn Communicator>,
        opts: VarunaOptions,
    ) -> Result<Self> {
        opts.validate(model, world.size())?;
        let topo = opts.topology()?;
        let coords = topo.coords(world.rank())?;
        let tp = Group::new(axis_group(world.as_ref(), &topo, Axis::Tensor)?);
        let pp = axis_group(world.as_ref(), &topo, Axis::Pipeline)?;
        let dp = axis_group(world.as_ref(), &topo, Axis::Replica)?;
        let cp = Group::new(axis_group(world.as_ref(), &topo, Axis::Context)?);
        let ep = Group::new(axis_group(world.as_ref(), &topo, Axis::Expert)?);
        let expert_dp = (topo.layout().ep > 1)
            .then(|| axis_group(world.as_ref(), &topo, Axis::ExpertReplica))
            .transpose()?;
        let init = Init::new(
            opts.device.clone(),
            opts.spec.precision.dtype(),
            opts.spec.seed,
        );
        let build = Build::new(init)
            .with_tp(tp.clone())
            .with_cp(cp.clone())
            .with_ep(ep.clone())
            .with_sequence_parallel(opts.spec.parallel.sequence_parallel);
        let popts = opts.pipeline_options()?;
        let mut pipeline = Pipeline::new(model, &build, pp, popts, opts.loss.clone())?;
        pipeline.set_replica(coords.dp_rank, topo.layout().dp);
        pipeline.enable_trace();
        let params = pipeline.params().to_vec();
        let master = if opts.spec.precision == Precision::F32 {
            params.clone()
        } else {
            // The f32 values a serial run starts from (the model holds them rounded).
            let f32_init = Init::new(opts.device.clone(), Precision::F32.dtype(), opts.spec.seed);
            let f32_build = Build::new(f32_init).with_tp(tp).with_ep(ep);
            let mut m = Vec::new();
            for (_, range) in pipeline.own_stages() {
                m.extend(model.build_range(range, &f32_build)?.params());
            }
            m
        };
        let masters = MasterWeights::new(params, master)?;
        masters.sync()?;
        let replicas = zero_groups::Replicas::of(dp.as_ref(), expert_dp.as_deref());
        let weights = zero::weights(
            opts.spec.parallel.zero,
            &mut pipeline,
            (
                &opts.shared_weights,
                opts.spec.overlap.bucket_bytes,
                opts.spec.overlap.live_layers(),
            ),
            replicas,
            expert_dp.is_some(),
            masters,
        )?;
        let scaler = opts
            .spec
            .precision
            .scales_loss()
            .then(|| opts.loss_scaler.clone());
        let has = Tensor::new(&[u32::from(!pipeline.experts().is_empty())], &Device::Cpu)?;
        let mixtures = world.all_reduce(&has, ReduceOp::Max)?.to_vec1::<u32>()?[0] == 1;
        let v = Self {
            topo,
            coords,
            world,
            dp,
            cp,
            expert_dp,
            pipeline,
            weights,
            optimizer: None,
            opts,
            scaler,
            grad_hook: None,
            summed_hook: None,
            busy: 0.0,
            wall: 0.0,
            parts: Vec::new(),
            trace: None,
            comm_trace: Vec::new(),
            pending: None,
            eval_rows: None,
            mixtures,
            loads: Vec::new(),
        };
        if let Some(f) = v.opts.batch_fn.clone() {
            let sample = f(0, v.opts.spec.batch.micro_batch)?;
            v.predict(&sample).map_err(|e| {
                invalid!(
                    "a sample batch of {} rows does not run through the model: {e}",
                    v.opts.spec.batch.micro_batch
                )
            })?;
        }
        Ok(v)
    }

    /// Registers the optimizer, made over this rank's f32 master parameters (Varuna's
    /// `set_optimizer`; make it after the wrapper, it needs the parameters). Under ZeRO it is
    /// made over this replica's pieces of them (see [`crate::parallel::zero`]).
    pub fn set_optimizer(
        &mut self,
        make: impl FnOnce(Vec<(String, Var)>) -> Result<Box<dyn Optimizer>>,
    ) -> Result<()> {
        self.optimizer = Some(make(self.optimized())?);
        Ok(())
    }

    /// Whether `flag` is set on any rank of the world (collective): so that every rank acts on
    /// one rank's notice (a preemption signal) at the same step.
    pub fn any_rank(&self, flag: bool) -> Result<bool> {
        let t = Tensor::new(&[u32::from(flag)], &Device::Cpu)?;
        Ok(self.world.all_reduce(&t, ReduceOp::Max)?.to_vec1::<u32>()?[0] == 1)
    }

    /// The optimizer, once [`Varuna::set_optimizer`] made it.
    pub fn optimizer(&self) -> Option<&dyn Optimizer> {
        self.optimizer.as_deref()
    }

    /// Called every step with this rank's f32, unscaled gradients, before the sum over
    /// replicas (under ZeRO-2, after it: this replica's pieces of the sums): to inspect or
    /// change them (tests inject an overflow with it).
    pub fn set_grad_hook(&mut self, hook: impl FnMut(&mut Grads) + Send + 'static) {
        self.grad_hook = Some(Box::new(hook));
    }

    /// Called every step that updates with this rank's gradients as the optimizer steps
    /// from them, before clipping: summed over the replicas, f32 and unscaled, whole or (under
    /// ZeRO) this rank's pieces ([`Varuna::zero_pieces`]). Parity tests compare each with
    /// the serial gradient's part.
    pub fn set_summed_grad_hook(&mut self, hook: impl FnMut(&Grads) + Send + 'static) {
        self.summed_hook = Some(Box::new(hook));
    }

    /// The job's placement of ranks.
    pub fn topology(&self) -> &Topology {
        &self.topo
    }

    /// This rank's (stage, tp rank, dp rank).
    pub fn coords(&self) -> Coords {
        self.coords
    }

    /// The pipeline this rank runs (its stages, shards and groups).
    pub fn pipeline(&self) -> &Pipeline {
        &self.pipeline
    }

    /// Rows of the global batch this rank's replica takes each step.
    pub fn replica_batch(&self) -> usize {
        self.opts.spec.batch.global_batch / self.topo.layout().dp
    }

    /// What each mixture of experts routed in the last step over the global batch (tokens per
    /// expert, the load-balancing loss), layer by layer in model order, the same on every
    /// rank; empty without mixtures.
    pub fn expert_loads(&self) -> &[ExpertLoad] {
        &self.loads
    }

    /// The loss scale the next step uses (1 unless f16).
    pub fn loss_scale(&self) -> f64 {
        self.scaler.as_ref().map_or(1.0, |s| s.scale())
    }

    /// The device this rank computes on.
    pub fn device(&self) -> &Device {
        &self.opts.device
    }

    /// Checks that `batch` holds what the model's first stage and the loss ask for (on every
    /// rank, so that all ranks fail alike instead of some waiting on others).
    /// Returns the batch's rows.
    fn check_batch(&self, batch: &Batch, with_targets: bool) -> Result<usize> {
        batch.require_all(self.pipeline.input_names(), "the model's first stage")?;
        if with_targets {
            batch.require_all(&self.opts.loss.targets(), "the loss")?;
        }
        batch.rows()
    }

    /// One training step on this replica's rows of the global batch (collective over the
    /// world). Returns the global loss and whether the step was skipped for an overflow.
    pub fn step(&mut self, batch: &Batch) -> Result<StepOutcome> {
        if self.optimizer.is_none() {
            return Err(invalid!("no optimizer: call set_optimizer before step"));
        }
        let rows = self.check_batch(batch, true)?;
        if rows != self.replica_batch() {
            return Err(invalid!(
                "step got {rows} rows but each of the {} replicas takes {} of the global batch of {}",
                self.topo.layout().dp,
                self.replica_batch(),
                self.opts.spec.batch.global_batch
            ));
        }
        let batch = self.local_batch(batch)?;
        let mut clock = PartClock::start();
        // This step's waits on data-parallel communication from now on.
        waited::take();
        let step = self.pipeline.steps_taken();
        self.trace_comm(step, false);
        let mine = self.opts.loss.count(&batch)?;
        let total = self.sum_dp_i64(mine as i64)? as usize;
        clock.lap(Part::Scalars);
        if total == 0 {
            return Err(invalid!(
                "the global batch has no counted target: every target is ignored"
            ));
        }
        let scale = self.loss_scale();
        let (loss, mut grads) = self.replica_grads(&batch, total, scale, &mut clock)?;
        let loss = self
            .dp
            .all_reduce(&Tensor::new(&[loss], &Device::Cpu)?, ReduceOp::Sum)?
            .to_vec1::<f64>()?[0];
        if self.mixtures {
            self.loads = self.gather_expert_loads()?;
        }
        clock.lap(Part::Scalars);
        let found = has_overflow(&grads)? || !loss.is_finite();
        clock.lap(Part::Update);
        let flag = Tensor::new(&[u32::from(found)], &Device::Cpu)?;
        let overflow = self
            .world
            .all_reduce(&flag, ReduceOp::Max)?
            .to_vec1::<u32>()?[0]
            == 1;
        clock.lap(Part::Scalars);
        let lr = self.opts.spec.optim.lr.lr_at(step);
        let mut outcome = StepOutcome {
            step,
            loss,
            overflow,
            grad_norm: f64::NAN,
            lr,
            loss_scale: scale,
            targets: total,
        };
        self.pipeline.finish_step();
        if overflow {
            return self.after_overflow(outcome);
        }
        let norm = if self.zero().shards_grads() {
            let c = self.replicas();
            self.pipeline
                .grad_norm_of_shards(&grads, Some([c.dense, c.experts]))?
        } else {
            self.pipeline.grad_norm(&grads)?
        };
        // ZeRO-1 cuts before clipping scales (the same bits: clipping scales each element).
        if let Some(z) = self.weights.sharded() {
            if z.stage() == Zero::OptimizerState {
                grads = z.cut_grads(&grads)?;
            }
        }
        if let Some(hook) = self.summed_hook.as_mut() {
            hook(&grads);
        }
        if let Some(max) = self.opts.spec.optim.clip {
            scale_to_norm(&mut grads, norm, max)?;
        }
        self.optimizer
            .as_mut()
            .expect("checked above")
            .step(&grads, lr)?;
        // The summed gradients are done with before the weights are gathered.
        drop(grads);
        self.weights.publish(self.replicas())?;
        if let Some(s) = self.scaler.as_mut() {
            s.update(false);
        }
        // DDP's broadcast_buffers: running statistics follow replica 0.
        for (_, b) in self.pipeline.buffers() {
            if self.dp.size() > 1 {
                b.set(&self.dp.broadcast(b.as_tensor(), 0)?)?;
            }
        }
        outcome.grad_norm = norm;
        clock.lap(Part::Update);
        let mut parts = clock.parts();
        parts.exposed_comm_s = waited::take();
        self.parts.push(parts);
        self.trace_comm(step, true);
        Ok(outcome)
    }

    /// Varuna's `evaluate`: the evaluation-mode mean loss of `batch` (as given, one pass, no
    /// micro-batches) and, with `keep_output`, the last stage's output (f32, whole), the same
    /// on every rank (each replica computes it; collective over the replica's ranks).
    pub fn evaluate(&self, batch: &Batch, keep_output: bool) -> Result<Evaluation> {
        self.check_batch(batch, true)?;
        let batch = self.local_batch(batch)?;
        let r = self.pipeline.forward_only(&batch, true, keep_output)?;
        let (sum, count) = self.sum_over_ring(r.loss.expect("asked for the loss"))?;
        if count == 0 {
            return Err(invalid!(
                "the batch has no counted target: every target is ignored"
            ));
        }
        Ok(Evaluation {
            loss: sum / count as f64,
            count,
            output: r
                .output
                .map(|o| self.whole_sequence(&o, None))
                .transpose()?,
        })
    }

    /// The evaluation-mode output (f32, whole) of the model for `batch`'s inputs, on every
    /// rank; the batch needs no targets. Under context parallelism sequences the ring does not
    /// split are padded on the right and the output cut back (exact for causal models). Rows
    /// go through at most [`Varuna::set_eval_rows`] at a time (all at once unless set).
    pub fn predict(&self, batch: &Batch) -> Result<Tensor> {
        self.check_batch(batch, false)?;
        let rows = batch.rows()?;
        let group = self.eval_rows.unwrap_or(rows).max(1);
        let mut out = Vec::with_capacity(rows.div_ceil(group));
        for start in (0..rows).step_by(group) {
            let part = batch.narrow(start, group.min(rows - start))?;
            let (part, len) = self.local_inputs(&part)?;
            let r = self.pipeline.forward_only(&part, false, true)?;
            out.push(self.whole_sequence(&r.output.expect("asked for the output"), len)?);
        }
        match out.len() {
            1 => Ok(out.remove(0)),
            _ => Ok(Tensor::cat(&out, 0)?),
        }
    }

    fn sum_dp_i64(&self, v: i64) -> Result<i64> {
        Ok(self
            .dp
            .all_reduce(&Tensor::new(&[v], &Device::Cpu)?, ReduceOp::Sum)?
            .to_vec1::<i64>()?[0])
    }
}
