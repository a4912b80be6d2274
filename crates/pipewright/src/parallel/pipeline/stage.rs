//! [`PipelineStage`]: the model stages one pipeline rank holds and what runs on them (the
//! forward of a micro-batch here, its backward in [`super::backward`], receives and skips in
//! [`super::io`], evaluation in [`super::evaluate`]), apart from the schedule that orders
//! them ([`super::executor::Pipeline`]), as torch.distributed.pipelining separates a
//! `PipelineStage` from its schedule.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::sync::atomic::AtomicU64;
use std::sync::Mutex;

use candle_core::{Device, Tensor, Var};

use super::options::PipelineOptions;
use super::partition::partition;
use super::schedule::{Action, Schedule};
use super::segments::Cuts;
use super::skip::Skips;
use super::transfer::Tags;
use crate::distributed::comm::{Communicator, Group};
use crate::model::batch::Batch;
use crate::model::deferred::WeightGradQueue;
use crate::model::expert_load::{merge, ExpertLoad};
use crate::model::{Activation, Build, Cx, Mode, Sequential, Stage};
use crate::parallel::loss::SharedLoss;
use crate::{invalid, Result};

/// What a training forward of one stage gives: its output (on the last stage the loss), the
/// skips it sends on, and where it was cut into one graph per layer (ZeRO-3).
pub(super) type Forward = (Activation, Vec<(usize, Tensor)>, Option<Cuts>);

/// The model stages one rank holds, built, with what their forwards and backwards need: the
/// pipeline communicator, where every other stage is, the skip routes and message tags, the
/// tensor-parallel group, the loss, and the step and micro-batch numbers that seed dropout.
pub struct PipelineStage {
    pub(super) comm: Box<dyn Communicator>,
    /// The rank that holds each model stage.
    placement: Vec<usize>,
    /// (model stage, built layers) of each stage this rank holds, in stage order.
    pub(super) own: Vec<(usize, Stage)>,
    pub(super) ranges: Vec<Range<usize>>,
    pub(super) skips: Skips,
    pub(super) tags: Tags,
    /// The tensor-parallel group every stage of this rank is split over.
    pub(super) tp: Group,
    /// The expert-parallel group its mixtures' experts are split over.
    pub(super) ep: Group,
    pub(super) loss: SharedLoss,
    pub(super) device: Device,
    /// Index of this rank's first micro-batch in the global batch (data parallelism): dropout
    /// masks are keyed by it, so a replica draws what a serial run draws for those rows.
    pub(super) mb_offset: usize,
    /// Data-parallel replicas, each running `opts.micro_batches` micro-batches of a step.
    pub(super) replicas: usize,
    pub(super) opts: PipelineOptions,
    pub(super) step: u64,
    /// Deferred weight gradients per model stage of this rank whose backward the schedule
    /// splits (zero-bubble schedules; one queue per stage, so a weight pass takes its own
    /// stage's work when a rank holds two) ...
    pub(super) queues: HashMap<usize, WeightGradQueue>,
    /// ... and the (model stage, micro-batch) pairs it splits: their forwards defer their
    /// weight gradients, the others' backwards run whole (DualPipeV splits only its last).
    pub(super) split: HashSet<(usize, usize)>,
    /// Nanoseconds spent in receives, for [`super::trace::TraceEvent::wait_us`].
    pub(super) waited_ns: AtomicU64,
    /// What this rank's mixtures of experts routed in the step's forwards (recomputations
    /// left out).
    pub(super) loads: Mutex<Vec<ExpertLoad>>,
}

impl PipelineStage {
    /// Builds the stages `schedule` gives this rank (`comm`'s rank) from `model` on `build`'s
    /// device.
    pub(super) fn new(
        model: &Sequential,
        build: &Build,
        comm: Box<dyn Communicator>,
        schedule: &Schedule,
        opts: PipelineOptions,
        loss: SharedLoss,
    ) -> Result<Self> {
        let ranges = partition(model, schedule.stages, opts.spec.layers()?)?;
        let own = schedule
            .stages_of(comm.rank())
            .into_iter()
            .map(|k| Ok((k, model.build_range(ranges[k].clone(), build)?)))
            .collect::<Result<Vec<_>>>()?;
        let skips = Skips::new(model, &ranges)?;
        let split: HashSet<(usize, usize)> = schedule.actions[comm.rank()]
            .iter()
            .filter(|a| matches!(a, Action::BackwardInput { .. }))
            .map(|a| (a.stage(), a.mb()))
            .collect();
        let tags = Tags::new(
            schedule.stages,
            opts.micro_batches,
            skips.routes().len(),
            opts.tied.len(),
        )?;
        Ok(Self {
            comm,
            placement: schedule.placement()?,
            own,
            ranges,
            skips,
            tags,
            tp: build.tp.clone(),
            ep: build.ep.clone(),
            loss,
            device: build.device.clone(),
            mb_offset: 0,
            replicas: 1,
            queues: split
                .iter()
                .map(|(k, _)| (*k, WeightGradQueue::new()))
                .collect(),
            split,
            opts,
            step: 0,
            waited_ns: AtomicU64::new(0),
            loads: Mutex::default(),
        })
    }

    /// The queue the forward of micro-batch `mb` on model stage `k` defers its weight
    /// gradients to: `Some` where the schedule splits that backward.
    pub(super) fn weight_queue(&self, k: usize, mb: usize) -> Option<WeightGradQueue> {
        self.split
            .contains(&(k, mb))
            .then(|| self.queues.get(&k).cloned())
            .flatten()
    }

    /// Weight gradients queued and not yet computed, over this rank's stages.
    pub(super) fn pending_weight_grads(&self) -> usize {
        self.queues.values().map(WeightGradQueue::pending).sum()
    }

    /// The number of model stages over all ranks.
    pub(super) fn stage_count(&self) -> usize {
        self.placement.len()
    }

    /// The pipeline rank that holds model stage `k`.
    pub(super) fn rank_of(&self, k: usize) -> usize {
        self.placement[k]
    }

    /// The built layers of model stage `k`, which this rank holds.
    pub(super) fn own_stage(&self, k: usize) -> Result<&Stage> {
        self.own
            .iter()
            .find(|(s, _)| *s == k)
            .map(|(_, s)| s)
            .ok_or_else(|| {
                invalid!(
                    "rank {} was asked to run stage {k}, which it does not hold",
                    self.comm.rank()
                )
            })
    }

    /// Runs model stage `k` in training mode; on the last stage the output becomes the
    /// micro-batch's loss over `denominator`; auxiliary losses weigh `loss_scale` over the
    /// global batch's micro-batches. When the stage releases its parameters between
    /// uses (ZeRO-3), or for the last micro-batch when its gradient sums overlap its backward
    /// ([`PipelineOptions::cut_last`](super::PipelineOptions::cut_last)), the forward is cut
    /// into one graph per layer, and the cuts come back too.
    pub(super) fn train_forward(
        &self,
        (k, mb): (usize, usize),
        x: Activation,
        imports: &[(usize, Var)],
        batch: &Batch,
        (denominator, loss_scale): (usize, f64),
        recomputing: bool,
    ) -> Result<Forward> {
        let last = k + 1 == self.stage_count();
        let stage = self.own_stage(k)?;
        let last_mb = self.opts.cut_last && mb + 1 == self.opts.micro_batches;
        let mut cuts = (stage.releases_params() || last_mb).then(Cuts::default);
        let mut cx = Cx::new(Mode::Train, self.opts.seed, self.step, mb + self.mb_offset);
        cx.defer_batch_stats = self.opts.spec.deferred_batch_norm;
        cx.detect_anomaly = self.opts.detect_anomaly;
        cx.weight_grads = self.weight_queue(k, mb);
        cx.aux_weight = loss_scale / (self.opts.micro_batches * self.replicas) as f64;
        // The same context as the first forward: same dropout masks; layers with side effects
        // (BatchNorm statistics) see is_recomputing().
        cx.set_recomputing(recomputing);
        if k == 0 {
            for name in self.input_names() {
                if let (Some(t), Some(host)) = (batch.get(name), batch.host_copy(name)) {
                    cx.set_host_copy(t, host.clone());
                }
            }
        }
        let (out, exports) =
            self.skips
                .run(stage, (k, last), x, imports, &mut cx, cuts.as_mut())?;
        if !recomputing {
            let mut loads = self.loads.lock().unwrap_or_else(|e| e.into_inner());
            merge(&mut loads, std::mem::take(&mut cx.expert_loads));
        }
        if !last {
            return Ok((out, exports, cuts));
        }
        let out = self.loss.input(out, &mut cx)?;
        let (sum, _) = self.loss.sum(&out, batch, &cx, &self.tp)?;
        Ok(((sum / denominator as f64)?.into(), exports, cuts))
    }

    /// The batch tensors the model's first stage takes.
    pub fn input_names(&self) -> &[String] {
        self.own[0].1.input_names()
    }
}
