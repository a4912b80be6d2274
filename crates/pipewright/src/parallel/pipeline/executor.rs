//! Runs one rank's schedule: receive activation, forward, send; receive gradient, backward,
//! send; accumulate parameter gradients over micro-batches. [`Pipeline`] computes one batch's
//! loss and gradients on this rank and owns no optimizer: [`crate::engine::varuna::Varuna`] steps it.
//!
//! Every rank of the pipeline communicator builds only the model stages its list of the
//! schedule names (see [`super::schedule`] for where the built schedules place them) and calls
//! [`Pipeline::loss_and_grads`] with the same batch.
//! Sends are non-blocking and completed at the end of the step, so a schedule that is
//! deadlock-free as data (see [`super::schedule`]) cannot deadlock on blocking sends either.
//! What crosses a cut is in [`super::transfer`], skips in [`super::skip`], tied weights in
//! [`super::tied`], recomputation in [`super::recompute`], tracing in [`super::trace`].
//!
//! Zero-bubble schedules split the backward: forwards run with a weight-gradient queue
//! ([`crate::model::deferred`]), an input-gradient action (I) runs the backward, which then gives
//! only input, bias and norm gradients, and the weight-gradient action (W) of the same
//! micro-batch computes the queued weight gradients later.

use std::ops::Range;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Tensor, Var};

use super::actions::{Held, StepState};
use super::evaluate::ForwardOnly;
pub use super::options::PipelineOptions;
use super::schedule::Schedule;
use super::sink::GradSink;
use super::stage::PipelineStage;
use super::tied::Tied;
use super::trace::TraceEvent;
use crate::distributed::comm::Group;
use crate::distributed::comm::{Communicator, ReduceOp};
use crate::model::batch::Batch;
use crate::model::deferred::leftover;
use crate::model::nn::{sum_sq_share, Grads};
use crate::model::{Build, LayerParams, Sequential};
use crate::parallel::loss::SharedLoss;
use crate::{invalid, Result};

/// One layer's parameters: (model stage, layer, its parameters with their global names).
pub type LayerParamsOf = (usize, usize, Vec<(String, Var)>);

/// One rank of a pipeline: runs its list of the schedule's actions on its [`PipelineStage`],
/// keeps tied weights equal, and counts what it holds.
pub struct Pipeline {
    stage: PipelineStage,
    schedule: Schedule,
    tied: Tied,
    params: Vec<(String, Var)>,
    /// The names of the sharded parameters.
    sharded: Vec<String>,
    /// The names of the experts' parameters (held by this expert-parallel rank alone).
    experts: Vec<String>,
    /// Activations and stage inputs held at most during the last step.
    held: Held,
    /// Executed actions, when tracing.
    trace: Option<Vec<TraceEvent>>,
    epoch: Instant,
}

impl Pipeline {
    /// Builds this rank's part of `model` on `build`'s device; `comm` spans the pipeline's
    /// ranks in stage order, and `loss` is computed on the last stage.
    pub fn new(
        model: &Sequential,
        build: &Build,
        comm: Box<dyn Communicator>,
        opts: PipelineOptions,
        loss: SharedLoss,
    ) -> Result<Self> {
        let schedule = opts.spec.schedule_for(comm.size(), opts.micro_batches)?;
        let stage = PipelineStage::new(model, build, comm, &schedule, opts, loss)?;
        let params: Vec<(String, Var)> = stage.own.iter().flat_map(|(_, s)| s.params()).collect();
        let tied = Tied::new(stage.comm.as_ref(), &params, &stage.opts.tied)?;
        let sharded = stage
            .own
            .iter()
            .flat_map(|(_, s)| {
                crate::parallel::tensor_parallel::register_ddp_parameters_to_ignore(s)
            })
            .collect();
        let experts = stage.own.iter().flat_map(|(_, s)| s.experts()).collect();
        Ok(Self {
            stage,
            schedule,
            tied,
            params,
            sharded,
            experts,
            held: Held::default(),
            trace: None,
            epoch: Instant::now(),
        })
    }

    /// The part of the pipeline that computes: this rank's model stages and their transfers.
    pub fn stage(&self) -> &PipelineStage {
        &self.stage
    }

    /// [`PipelineStage::forward_only`] (collective over the pipeline).
    pub fn forward_only(
        &self,
        batch: &Batch,
        with_loss: bool,
        with_output: bool,
    ) -> Result<ForwardOnly> {
        self.stage.forward_only(batch, with_loss, with_output)
    }

    /// This rank is in data-parallel replica `index` of `replicas`: its micro-batches are
    /// numbered from its replica's first in the global batch (for seeded randomness), and an
    /// auxiliary loss of each weighs one micro-batch of all the replicas' ([`crate::model::Cx::aux_weight`]).
    pub fn set_replica(&mut self, index: usize, replicas: usize) {
        self.stage.mb_offset = index * self.stage.opts.micro_batches;
        self.stage.replicas = replicas.max(1);
    }

    /// The model stages this rank holds and their layer ranges.
    pub fn own_stages(&self) -> Vec<(usize, Range<usize>)> {
        self.stage
            .own
            .iter()
            .map(|(k, _)| (*k, self.stage.ranges[*k].clone()))
            .collect()
    }

    /// How each sharded parameter of this rank's stages is split.
    pub fn shards(&self) -> Vec<(String, crate::parallel::tensor_parallel::Shard)> {
        self.stage
            .own
            .iter()
            .flat_map(|(_, s)| s.shards())
            .collect()
    }

    /// What this rank's mixtures of experts routed since the last call (every training
    /// forward of its stages, recomputations left out), layer by layer.
    pub fn take_expert_loads(&self) -> Vec<crate::model::expert_load::ExpertLoad> {
        let mut loads = self.stage.loads.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(&mut *loads)
    }

    /// The names of this rank's experts' parameters ([`crate::model::Layer::experts`]).
    pub fn experts(&self) -> &[String] {
        &self.experts
    }

    /// The expert-parallel group this rank's mixtures split their experts over.
    pub fn ep(&self) -> &Group {
        &self.stage.ep
    }

    /// The tensor-parallel group this rank's stages are split over.
    pub fn tp(&self) -> &Group {
        &self.stage.tp
    }

    /// The pipeline's communicator (this rank's stages and their neighbours).
    pub fn comm(&self) -> &dyn Communicator {
        self.stage.comm.as_ref()
    }

    /// Layer ranges of every model stage.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.stage.ranges
    }

    /// The schedule every rank of the pipeline runs (which rank holds each stage:
    /// [`Schedule::placement`]).
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The batch tensors the model's first stage takes.
    pub fn input_names(&self) -> &[String] {
        self.stage.input_names()
    }

    /// This rank's buffers (BatchNorm running statistics) with their global names.
    pub fn buffers(&self) -> Vec<(String, Var)> {
        self.stage
            .own
            .iter()
            .flat_map(|(_, s)| s.buffers())
            .collect()
    }

    /// This rank's parameters with their global names. Under ZeRO-3 their storage is empty
    /// between the uses of their layer: read values with
    /// [`crate::engine::varuna::Varuna::parameters`].
    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// This rank's parameters by layer, in order: (model stage, layer, its parameters).
    pub fn params_by_layer(&self) -> Vec<LayerParamsOf> {
        let stages = self.stage.own.iter();
        stages
            .flat_map(|(k, s)| s.range().map(move |l| (*k, l, s.layer_params(l))))
            .collect()
    }

    /// Keeps every stage's parameters in `params` between uses (ZeRO-3, see
    /// [`crate::model::Stage::set_layer_params`]).
    pub fn set_layer_params(&mut self, params: Option<Arc<dyn LayerParams>>) {
        for (_, s) in &mut self.stage.own {
            s.set_layer_params(params.clone());
        }
    }

    /// Number of scalar parameters of the whole model, over all ranks of the pipeline
    /// (collective over the pipeline's ranks).
    pub fn total_params(&self) -> Result<usize> {
        // A sharded parameter counts at its whole size (every shard is the same size).
        let mine: usize = self
            .params
            .iter()
            .map(|(n, v)| {
                let mut parts = 1;
                if self.sharded.contains(n) {
                    parts *= self.stage.tp.size();
                }
                if self.experts.contains(n) {
                    parts *= self.stage.ep.size();
                }
                v.elem_count() * parts
            })
            .sum();
        let t = Tensor::new(&[mine as i64], &Device::Cpu)?;
        Ok(self
            .stage
            .comm
            .all_reduce(&t, ReduceOp::Sum)?
            .to_vec1::<i64>()?[0] as usize)
    }

    /// Most micro-batch activations (the graph of a stage's forward) this rank held at once
    /// between actions during the last step.
    pub fn peak_activations(&self) -> usize {
        self.held.peak_activations
    }

    /// Most stage inputs this rank held at once during the last step.
    pub fn peak_inputs(&self) -> usize {
        self.held.peak_inputs
    }

    /// Starts recording every executed action (see [`Pipeline::take_trace`]).
    pub fn enable_trace(&mut self) {
        self.trace.get_or_insert_with(Vec::new);
    }

    /// Microseconds from the pipeline's making to `t`: the clock of its trace.
    pub fn trace_us(&self, t: Instant) -> f64 {
        t.saturating_duration_since(self.epoch).as_secs_f64() * 1e6
    }

    /// The actions recorded so far.
    pub fn take_trace(&mut self) -> Vec<TraceEvent> {
        self.trace.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The loss of this rank's batch over `denominator` (the global batch's count, see
    /// [`crate::parallel::loss::Loss::count`]) and this rank's parameter gradients of that loss times
    /// `loss_scale` (tied pairs summed across their owners; the reported loss is unscaled).
    pub fn loss_and_grads(
        &mut self,
        batch: &Batch,
        denominator: usize,
        loss_scale: f64,
    ) -> Result<(f64, Grads)> {
        self.loss_and_grads_into(batch, denominator, loss_scale, None)
    }

    /// [`Pipeline::loss_and_grads`] with each micro-batch's gradients given to `sink` as soon
    /// as they are complete; the gradients returned are those it gave back.
    pub fn loss_and_grads_into(
        &mut self,
        batch: &Batch,
        denominator: usize,
        loss_scale: f64,
        sink: Option<&mut dyn GradSink>,
    ) -> Result<(f64, Grads)> {
        let mbs = batch.split(self.stage.opts.micro_batches)?;
        if mbs.len() != self.schedule.micro_batches {
            return Err(invalid!(
                "a batch of {} rows splits into {} micro-batches, not the {} the schedule was \
                 built for: make the batch at least as large as the number of chunks",
                batch.rows()?,
                mbs.len(),
                self.schedule.micro_batches
            ));
        }
        let mut st = StepState::new(&self.stage, mbs, denominator, loss_scale, sink);
        let actions = self.schedule.actions[self.stage.comm.rank()].clone();
        for a in actions {
            let started = self.epoch.elapsed().as_secs_f64() * 1e6;
            let waited_before = self.stage.waited_ns.load(Ordering::Relaxed);
            // (A system call: only for a trace.)
            let cpu_before = self
                .trace
                .as_ref()
                .and_then(|_| crate::runtime::cpu_time::thread_cpu_seconds());
            let recomputed = st.run(a)?;
            if let Some(trace) = self.trace.as_mut() {
                let now = self.epoch.elapsed().as_secs_f64() * 1e6;
                let waited = self.stage.waited_ns.load(Ordering::Relaxed) - waited_before;
                trace.push(TraceEvent {
                    step: self.stage.step,
                    action: a,
                    start_us: started,
                    dur_us: now - started,
                    recomputed,
                    wait_us: waited as f64 / 1e3,
                    cpu_us: crate::runtime::cpu_time::thread_cpu_seconds()
                        .zip(cpu_before)
                        .map(|(now, then)| (now - then) * 1e6),
                });
            }
        }
        let StepState {
            sends,
            mut grads,
            loss,
            held,
            ..
        } = st;
        self.held = held;
        for s in sends {
            s.wait()?;
        }
        let n = self.stage.pending_weight_grads();
        if n > 0 {
            return Err(leftover(n));
        }
        for (_, stage) in &self.stage.own {
            stage.finish_batch()?;
        }
        self.tied.sum_grads(self.stage.comm.as_ref(), &mut grads)?;
        // Every rank reports the batch loss (only the last stage computed it).
        let loss = match loss {
            Some(sum) => sum.to_scalar::<f64>()?,
            None => 0.0,
        };
        let l = Tensor::new(&[loss], &Device::Cpu)?;
        let loss = self
            .stage
            .comm
            .all_reduce(&l, ReduceOp::Sum)?
            .to_vec1::<f64>()?[0];
        Ok((loss, grads))
    }

    /// The global gradient norm of the model the pipeline holds, from this rank's `grads`
    /// (collective over the pipeline and the tensor-parallel group): each tied pair and each
    /// whole parameter counted once, each shard once.
    pub fn grad_norm(&self, grads: &Grads) -> Result<f64> {
        self.grad_norm_of_shards(grads, None)
    }

    /// [`Pipeline::grad_norm`] when each member of `shards` (under ZeRO-2: every replica,
    /// and the ranks holding the same experts) holds its own part of each gradient: the
    /// parts' squares are summed over them first, the experts' over the second.
    pub fn grad_norm_of_shards(
        &self,
        grads: &Grads,
        shards: Option<[&dyn Communicator; 2]>,
    ) -> Result<f64> {
        let (mut dense, mut experts) = (Grads::new(), Grads::new());
        for (n, g) in grads.iter() {
            match self.experts.contains(n) {
                true => experts.insert(n.clone(), g.clone()),
                false => dense.insert(n.clone(), g.clone()),
            }
        }
        let tp = self.stage.tp.rank();
        let share = |g: &Grads| sum_sq_share(g, self.tied.pairs(), &self.sharded, tp);
        let mut sq = [share(&dense)?, share(&experts)?];
        if let Some(comms) = shards {
            for (s, c) in sq.iter_mut().zip(comms) {
                if c.size() > 1 {
                    let t = c.all_reduce(&Tensor::new(&[*s], &Device::Cpu)?, ReduceOp::Sum)?;
                    *s = t.to_vec1::<f64>()?[0];
                }
            }
        }
        // Each rank of an expert group holds other experts; the rest it holds as they do.
        let e = Tensor::new(&[sq[1]], &Device::Cpu)?;
        let e = self
            .stage
            .ep
            .all_reduce(&e, ReduceOp::Sum)?
            .to_vec1::<f64>()?[0];
        let sq = Tensor::new(&[sq[0] + e], &Device::Cpu)?;
        let sq = self.stage.comm.all_reduce(&sq, ReduceOp::Sum)?;
        let sq = self.stage.tp.all_reduce(&sq, ReduceOp::Sum)?;
        Ok(sq.to_vec1::<f64>()?[0].max(0.0).sqrt())
    }

    /// Advances the step counter (numbers dropout masks; a step skipped on overflow counts).
    pub fn finish_step(&mut self) {
        self.stage.step += 1;
    }

    /// Steps taken.
    pub fn steps_taken(&self) -> u64 {
        self.stage.step
    }

    /// Sets the steps taken (when resuming from a checkpoint).
    pub fn set_steps_taken(&mut self, step: u64) {
        self.stage.step = step;
    }
}
