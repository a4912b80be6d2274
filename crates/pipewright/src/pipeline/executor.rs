//! Runs one rank's schedule: receive activation, forward, send; receive gradient, backward,
//! send; accumulate parameter gradients over micro-batches; step the optimizer once per batch.
//!
//! Every rank of the pipeline communicator builds only its own model chunks (chunk `c` of rank
//! `r` is model stage `c * p + r`) and calls [`Pipeline::step`] with the same batch. Sends are
//! non-blocking and completed at the end of the step, so a schedule that is deadlock-free as
//! data (see [`super::schedule`]) cannot deadlock on blocking sends either.
//!
//! Zero-bubble schedules split the backward: forwards run with a weight-gradient queue
//! ([`crate::nn::deferred`]), an input-gradient action (I) runs the backward, which then gives
//! only input, bias and norm gradients, and the weight-gradient action (W) of the same
//! micro-batch computes the queued weight gradients later.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{DType, Tensor, Var};

use super::partition::partition;
use super::schedule::{Action, Kind, Schedule};
use crate::comm::{Communicator, Pending, ReduceOp, MAX_TAG};
use crate::model::{Activation, Cx, Mode, Sequential, Stage};
use crate::nn::deferred::{leftover, WeightGradQueue};
use crate::nn::optim::{scale_to_norm, LrSchedule, Optimizer};
use crate::nn::{Grads, Init};
use crate::serial::{count_targets, split_batch, sum_sq_share, whole_output, StepReport};
use crate::shard::{loss_sum, TpGroup};
use crate::{invalid, Error, Result};

/// Activation recomputation (torchgpipe's `checkpoint`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recompute {
    /// Every micro-batch keeps only its stage input; the backward re-runs the forward.
    Always,
    /// Every micro-batch but the last of the batch (whose backward comes first in GPipe).
    ExceptLast,
    /// Keep every activation.
    Never,
}

impl std::str::FromStr for Recompute {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s {
            "always" => Recompute::Always,
            "except_last" | "except-last" => Recompute::ExceptLast,
            "never" => Recompute::Never,
            _ => {
                return Err(invalid!(
                    "unknown recompute mode `{s}`: use always, except_last or never"
                ))
            }
        })
    }
}

/// How to split and schedule.
#[derive(Clone, Debug)]
pub struct PipelineOptions {
    /// Micro-batches per batch.
    pub chunks: usize,
    pub schedule: Kind,
    /// Model chunks per rank (interleaved schedule).
    pub virtual_stages: usize,
    /// Layers (or segments between cut points) per model stage; uniform if `None`.
    pub balance: Option<Vec<usize>>,
    pub seed: u64,
    /// Parameter pairs kept equal across stages (GPT's `wte.weight`, `lm_head.weight`).
    pub tied: Vec<(String, String)>,
    pub clip: Option<f64>,
    pub lr: LrSchedule,
    pub recompute: Recompute,
    /// Deferred batch norm: running statistics move once per batch, over all micro-batches.
    pub deferred_batch_norm: bool,
}

/// One executed action, for a Chrome trace.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEvent {
    pub step: u64,
    pub action: Action,
    /// Microseconds since the pipeline was made.
    pub start_us: f64,
    pub dur_us: f64,
    /// True when the action recomputed its forward first (traced as R plus the backward).
    pub recomputed: bool,
    /// Microseconds of the action spent waiting for a neighbour's tensor (the rest computed).
    pub wait_us: f64,
}

/// What a forward left for its backward.
struct Saved {
    /// The stage input: a variable when it came from the previous stage (its gradient goes
    /// back), the batch's own tensor on the first stage.
    x: Tensor,
    input: Option<Var>,
    /// The stage output (to inject the incoming gradient) or, on the last stage, the loss;
    /// `None` when the forward is to be recomputed.
    output: Option<Tensor>,
    /// Skip tensors received from earlier stages (their gradients go back there).
    imports: Vec<(usize, Var)>,
    /// Skip tensors sent to later stages (their gradients come back); `None` when recomputed.
    exports: Option<Vec<(usize, Tensor)>>,
}

/// A skip connection whose ends sit on different model stages.
#[derive(Clone, Debug)]
struct Route {
    name: String,
    from: usize,
    to: usize,
}

/// One rank of a pipeline.
pub struct Pipeline {
    comm: Box<dyn Communicator>,
    schedule: Schedule,
    /// (model stage, built layers) for each chunk of this rank.
    chunks: Vec<(usize, Stage)>,
    ranges: Vec<Range<usize>>,
    routes: Vec<Route>,
    params: Vec<(String, Var)>,
    /// The tensor-parallel group every stage of this rank is split over, and the names of the
    /// sharded parameters.
    tp: TpGroup,
    sharded: Vec<String>,
    /// `None` until [`Pipeline::set_optimizer`] (the Varuna wrapper steps its own).
    optimizer: Option<Box<dyn Optimizer>>,
    /// Index of this rank's first micro-batch in the global batch (data parallelism): dropout
    /// masks are keyed by it, so a replica draws what a serial run draws for those rows.
    mb_offset: usize,
    opts: PipelineOptions,
    step: u64,
    /// Activations held now and at most during the last step (micro-batches, all chunks).
    held: usize,
    peak_held: usize,
    /// Stage inputs held now and at most during the last step.
    inputs_held: usize,
    peak_inputs: usize,
    /// Executed actions, when tracing.
    trace: Option<Vec<TraceEvent>>,
    /// Deferred weight gradients (zero-bubble schedules only).
    queue: Option<WeightGradQueue>,
    epoch: std::time::Instant,
    /// Nanoseconds spent in receives, for [`TraceEvent::wait_us`].
    waited_ns: std::sync::atomic::AtomicU64,
}

impl Pipeline {
    /// Builds this rank's part of `model`; `comm` spans the pipeline's ranks in stage order.
    pub fn new(
        model: &Sequential,
        init: &Init,
        comm: Box<dyn Communicator>,
        opts: PipelineOptions,
        make_optimizer: impl FnOnce(Vec<(String, Var)>) -> Result<Box<dyn Optimizer>>,
    ) -> Result<Self> {
        let mut p = Self::without_optimizer(model, init, comm, opts)?;
        p.optimizer = Some(make_optimizer(p.params.clone())?);
        Ok(p)
    }

    /// Builds this rank's part with no optimizer: [`Pipeline::loss_and_grads`] works,
    /// [`Pipeline::step`] needs [`Pipeline::set_optimizer`] first.
    pub fn without_optimizer(
        model: &Sequential,
        init: &Init,
        comm: Box<dyn Communicator>,
        opts: PipelineOptions,
    ) -> Result<Self> {
        opts.lr.validate()?;
        let (p, v) = (comm.size(), opts.virtual_stages);
        let schedule = Schedule::new(opts.schedule, p, opts.chunks, v)?;
        let queue = (opts.schedule == Kind::ZeroBubbleH1).then(WeightGradQueue::new);
        let ranges = partition(model, p * v, opts.balance.as_deref())?;
        let r = comm.rank();
        let chunks = (0..v)
            .map(|c| {
                let k = c * p + r;
                Ok((k, model.build_range(ranges[k].clone(), init)?))
            })
            .collect::<Result<Vec<_>>>()?;
        let stage_of = |layer: usize| ranges.iter().position(|r| r.contains(&layer)).unwrap_or(0);
        let routes: Vec<Route> = model
            .skips()?
            .into_iter()
            .map(|s| Route {
                from: stage_of(s.from),
                to: stage_of(s.to),
                name: s.name,
            })
            .filter(|r| r.from != r.to)
            .collect();
        let params: Vec<(String, Var)> = chunks.iter().flat_map(|(_, s)| s.params()).collect();
        let sharded = chunks
            .iter()
            .flat_map(|(_, s)| crate::shard::register_ddp_parameters_to_ignore(s))
            .collect();
        let total = 2 * (p * v + routes.len()) * (opts.chunks + 1);
        if total as u64 >= MAX_TAG {
            return Err(invalid!("{} micro-batches over {} model stages need more message tags than a communicator has", opts.chunks, p * v));
        }
        Ok(Self {
            comm,
            schedule,
            chunks,
            ranges,
            routes,
            params,
            tp: init.tp.clone(),
            sharded,
            optimizer: None,
            mb_offset: 0,
            opts,
            step: 0,
            held: 0,
            peak_held: 0,
            inputs_held: 0,
            peak_inputs: 0,
            trace: None,
            epoch: std::time::Instant::now(),
            queue,
            waited_ns: Default::default(),
        })
    }

    /// Sets the optimizer [`Pipeline::step`] uses (over [`Pipeline::params`]).
    pub fn set_optimizer(&mut self, optimizer: Box<dyn Optimizer>) {
        self.optimizer = Some(optimizer);
    }

    /// Numbers this rank's micro-batches from `offset` (its replica's first micro-batch in the
    /// global batch), for seeded randomness.
    pub fn set_micro_batch_offset(&mut self, offset: usize) {
        self.mb_offset = offset;
    }

    /// The model stages this rank holds and their layer ranges.
    pub fn own_stages(&self) -> Vec<(usize, Range<usize>)> {
        self.chunks
            .iter()
            .map(|(k, _)| (*k, self.ranges[*k].clone()))
            .collect()
    }

    /// How each sharded parameter of this rank's stages is split.
    pub fn shards(&self) -> Vec<(String, crate::shard::Shard)> {
        self.chunks.iter().flat_map(|(_, s)| s.shards()).collect()
    }

    /// The tensor-parallel group this rank's stages are split over.
    pub fn tp(&self) -> &TpGroup {
        &self.tp
    }

    /// The pipeline's communicator (this rank's stages and their neighbours).
    pub fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    /// Layer ranges of every model stage.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// This rank's buffers (BatchNorm running statistics) with their global names.
    pub fn buffers(&self) -> Vec<(String, Var)> {
        self.chunks.iter().flat_map(|(_, s)| s.buffers()).collect()
    }

    /// This rank's parameters with their global names.
    pub fn params(&self) -> &[(String, Var)] {
        &self.params
    }

    /// Number of scalar parameters of the whole model, over all ranks of the pipeline
    /// (collective over the pipeline's ranks).
    pub fn total_params(&self) -> Result<usize> {
        // A sharded parameter counts at its whole size (every shard is the same size).
        let mine: usize = self
            .params
            .iter()
            .map(|(n, v)| {
                let parts = if self.sharded.contains(n) {
                    self.tp.size()
                } else {
                    1
                };
                v.elem_count() * parts
            })
            .sum();
        let t = Tensor::new(&[mine as i64], &candle_core::Device::Cpu)?;
        Ok(self.comm.all_reduce(&t, ReduceOp::Sum)?.to_vec1::<i64>()?[0] as usize)
    }

    /// Most micro-batch activations (the graph of a stage's forward) this rank held at once
    /// between actions during the last step.
    pub fn peak_activations(&self) -> usize {
        self.peak_held
    }

    /// Starts recording every executed action (see [`Pipeline::take_trace`]).
    pub fn enable_trace(&mut self) {
        self.trace.get_or_insert_with(Vec::new);
    }

    /// The actions recorded so far.
    pub fn take_trace(&mut self) -> Vec<TraceEvent> {
        self.trace.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Most stage inputs this rank held at once during the last step.
    pub fn peak_inputs(&self) -> usize {
        self.peak_inputs
    }

    /// The micro-batch's loss over `total` (the batch's count of targets), in f32 whatever
    /// the model computes in (a cast keeps the output's split mark in `cx`).
    fn loss(&self, out: &Tensor, y: &Tensor, total: usize, cx: &mut Cx) -> Result<Tensor> {
        let out = if out.dtype() == DType::F32 {
            out.clone()
        } else {
            let o = out.to_dtype(DType::F32)?;
            cx.set_parallel_dim(&o, cx.parallel_dim(out));
            o
        };
        let (sum, _) = loss_sum(&out, y, cx, &self.tp)?;
        Ok((sum / total as f64)?)
    }

    fn stages(&self) -> usize {
        self.schedule.stages * self.schedule.chunks_per_stage
    }

    fn rank_of(&self, k: usize) -> usize {
        k % self.schedule.stages
    }

    fn tag(&self, mb: usize, k: usize, backward: bool) -> u64 {
        ((mb * self.stages() + k) * 2 + usize::from(backward)) as u64
    }

    /// Tag of skip route `i` for micro-batch `mb` (`mb` = micro-batches for evaluation).
    fn skip_tag(&self, mb: usize, i: usize, backward: bool) -> u64 {
        let base = 2 * self.stages() * (self.schedule.micro_batches + 1);
        (base + (mb * self.routes.len() + i) * 2 + usize::from(backward)) as u64
    }

    /// A receive whose waiting time counts as the running action's wait (see
    /// [`TraceEvent::wait_us`]).
    fn recv_timed(&self, src: usize, tag: u64) -> Result<Tensor> {
        let t0 = std::time::Instant::now();
        let t = self.comm.recv(src, tag)?;
        self.waited_ns.fetch_add(
            t0.elapsed().as_nanos() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        Ok(t)
    }

    /// Receives the skip tensors that model stage `k` pops from earlier stages.
    fn import_skips(&self, k: usize, mb: usize) -> Result<Vec<(usize, Var)>> {
        self.routes
            .iter()
            .enumerate()
            .filter(|(_, r)| r.to == k)
            .map(|(i, r)| {
                let t = self.recv_timed(self.rank_of(r.from), self.skip_tag(mb, i, false))?;
                Ok((i, Var::from_tensor(&t)?))
            })
            .collect()
    }

    /// Runs model stage `k`: stashes the imported skips, runs the layers, and pops the skips
    /// that later stages pop. Any other stash left over is an error.
    fn run_stage(
        &self,
        stage: &Stage,
        k: usize,
        x: &Tensor,
        imports: &[(usize, Var)],
        cx: &mut Cx,
    ) -> Result<(Tensor, Vec<(usize, Tensor)>)> {
        let here = format!("model stage {k}");
        for (i, v) in imports {
            cx.stash(&here, &self.routes[*i].name, v.as_tensor().clone())?;
        }
        let out = stage
            .forward(Activation::Tensor(x.clone()), cx)?
            .into_tensor("stage output")?;
        let rows = x.dims().first().copied();
        if k + 1 < self.stages() && out.dims().first().copied() != rows {
            let layer = self.ranges[k].end - 1;
            return Err(invalid!(
                "layer {layer} ends model stage {k} with an output of shape {:?} for a micro-batch of \
                 {} rows: what crosses a cut point must keep the batch on dim 0",
                out.dims(),
                rows.unwrap_or(0)
            ));
        }
        let exports = self
            .routes
            .iter()
            .enumerate()
            .filter(|(_, r)| r.from == k)
            .map(|(i, r)| Ok((i, cx.pop(&here, &r.name)?)))
            .collect::<Result<Vec<_>>>()?;
        let left = cx.stashed();
        if !left.is_empty() {
            return Err(invalid!(
                "{here}: skip connections {left:?} were stashed but nothing pops them: declare them \
                 with LayerSpec::stashes and LayerSpec::pops"
            ));
        }
        Ok((out, exports))
    }

    /// The loss of the batch and this rank's parameter gradients (tied pairs summed across
    /// their owners), without stepping.
    pub fn loss_and_grads(&mut self, inputs: &Tensor, targets: &Tensor) -> Result<(f64, Grads)> {
        let total = count_targets(targets)?;
        self.loss_and_grads_with(inputs, targets, total, 1.0)
    }

    /// [`Pipeline::loss_and_grads`] of a batch that is part of a larger one: the loss is
    /// divided by `denominator` (the larger batch's count of targets), and the gradients are
    /// of the loss times `loss_scale` (dynamic loss scaling; the reported loss is unscaled).
    pub fn loss_and_grads_with(
        &mut self,
        inputs: &Tensor,
        targets: &Tensor,
        denominator: usize,
        loss_scale: f64,
    ) -> Result<(f64, Grads)> {
        let (_, xs, ys) = split_batch(inputs, targets, self.opts.chunks)?;
        let total = denominator;
        if xs.len() != self.schedule.micro_batches {
            return Err(invalid!(
                "a batch of {} rows splits into {} micro-batches, not the {} the schedule was built for: \
                 make the batch size at least --chunks",
                inputs.dims().first().copied().unwrap_or(0),
                xs.len(),
                self.schedule.micro_batches
            ));
        }
        let last = self.stages() - 1;
        let mut saved: HashMap<(usize, usize), Saved> = HashMap::new();
        let mut sends: Vec<Pending<()>> = Vec::new();
        let mut grads = Grads::new();
        let mut awaiting_weight: HashMap<(usize, usize), bool> = HashMap::new();
        let mut loss = 0.0;
        self.held = 0;
        self.peak_held = 0;
        self.inputs_held = 0;
        self.peak_inputs = 0;
        let actions = self.schedule.actions[self.comm.rank()].clone();
        for a in actions {
            let started = self.epoch.elapsed().as_secs_f64() * 1e6;
            let waited_before = self.waited_ns.load(std::sync::atomic::Ordering::Relaxed);
            let mut recomputed = false;
            let (mb, c) = (a.mb(), a.chunk());
            let (k, stage) = (&self.chunks[c].0, &self.chunks[c].1);
            let k = *k;
            match a {
                Action::Forward { .. } => {
                    let (x, input) = if k == 0 {
                        (xs[mb].clone(), None)
                    } else {
                        let x = self.recv_timed(self.rank_of(k - 1), self.tag(mb, k - 1, false))?;
                        let v = Var::from_tensor(&x)?;
                        (v.as_tensor().clone(), Some(v))
                    };
                    let mut cx =
                        Cx::new(Mode::Train, self.opts.seed, self.step, mb + self.mb_offset);
                    cx.defer_batch_stats = self.opts.deferred_batch_norm;
                    cx.weight_grads = self.queue.clone();
                    let imports = self.import_skips(k, mb)?;
                    let (out, exports) = self.run_stage(stage, k, &x, &imports, &mut cx)?;
                    for (i, t) in &exports {
                        let to = self.rank_of(self.routes[*i].to);
                        sends.push(self.comm.isend(t, to, self.skip_tag(mb, *i, false))?);
                    }
                    let output = if k == last {
                        let l = self.loss(&out, &ys[mb], total, &mut cx)?;
                        loss += l.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                        l
                    } else {
                        sends.push(self.comm.isend(
                            &out,
                            self.rank_of(k + 1),
                            self.tag(mb, k, false),
                        )?);
                        out
                    };
                    let keep = match self.opts.recompute {
                        Recompute::Never => true,
                        Recompute::ExceptLast => mb + 1 == self.schedule.micro_batches,
                        Recompute::Always => false,
                    };
                    // Dropping the output drops the graph behind it: only the input stays.
                    saved.insert(
                        (mb, c),
                        Saved {
                            x,
                            input,
                            output: keep.then_some(output),
                            imports,
                            exports: keep.then_some(exports),
                        },
                    );
                    if keep {
                        self.held += 1;
                        self.peak_held = self.peak_held.max(self.held);
                    }
                    self.inputs_held += 1;
                    self.peak_inputs = self.peak_inputs.max(self.inputs_held);
                }
                Action::Backward { .. } | Action::BackwardInput { .. } => {
                    let s = saved.remove(&(mb, c)).ok_or_else(|| {
                        Error::Invalid(format!(
                            "stage {k}: backward of micro-batch {mb} before its forward"
                        ))
                    })?;
                    let kept = s.output.is_some();
                    let (output, exports) = match (s.output, s.exports) {
                        (Some(o), Some(e)) => (o, e),
                        _ => {
                            recomputed = true;
                            // The same context as the first forward: same dropout masks; layers
                            // with side effects (BatchNorm statistics) see is_recomputing().
                            let mut cx = Cx::new(
                                Mode::Train,
                                self.opts.seed,
                                self.step,
                                mb + self.mb_offset,
                            );
                            cx.set_recomputing(true);
                            cx.weight_grads = self.queue.clone();
                            let (out, exports) =
                                self.run_stage(stage, k, &s.x, &s.imports, &mut cx)?;
                            let out = if k == last {
                                self.loss(&out, &ys[mb], total, &mut cx)?
                            } else {
                                out
                            };
                            (out, exports)
                        }
                    };
                    // One backward for the output and every skip sent on: the gradients that
                    // come back are injected as (tensor * gradient).sum().
                    let mut objective = if k == last {
                        if loss_scale == 1.0 {
                            output
                        } else {
                            (output * loss_scale)?
                        }
                    } else {
                        let g = self.recv_timed(self.rank_of(k + 1), self.tag(mb, k, true))?;
                        (output * g.detach())?.sum_all()?
                    };
                    for (i, t) in exports {
                        let from = self.rank_of(self.routes[i].to);
                        let g = self.recv_timed(from, self.skip_tag(mb, i, true))?;
                        objective = (objective + (t * g.detach())?.sum_all()?)?;
                    }
                    let store = objective.backward()?;
                    grads.accumulate(Grads::from_store(&store, &stage.params()))?;
                    if let Some(input) = s.input {
                        let g = store
                            .get(input.as_tensor())
                            .cloned()
                            .map(Ok)
                            .unwrap_or_else(|| input.as_tensor().zeros_like())?;
                        sends.push(self.comm.isend(
                            &g,
                            self.rank_of(k - 1),
                            self.tag(mb, k - 1, true),
                        )?);
                    }
                    for (i, v) in &s.imports {
                        let g = store
                            .get(v.as_tensor())
                            .cloned()
                            .map(Ok)
                            .unwrap_or_else(|| v.as_tensor().zeros_like())?;
                        let from = self.rank_of(self.routes[*i].from);
                        sends.push(self.comm.isend(&g, from, self.skip_tag(mb, *i, true))?);
                    }
                    // Under a split backward the activations stay until the weight gradient.
                    if matches!(a, Action::BackwardInput { .. }) {
                        awaiting_weight.insert((mb, c), kept);
                    } else if kept {
                        self.held -= 1;
                    }
                    self.inputs_held -= 1;
                }
                Action::BackwardWeight { .. } => {
                    let queue = self.queue.as_ref().ok_or_else(|| {
                        invalid!("stage {k}: a weight-gradient action in a schedule without split backward")
                    })?;
                    grads.accumulate(queue.weight_grads(mb + self.mb_offset)?)?;
                    if awaiting_weight.remove(&(mb, c)) == Some(true) {
                        self.held -= 1;
                    }
                }
            }
            if let Some(trace) = self.trace.as_mut() {
                let now = self.epoch.elapsed().as_secs_f64() * 1e6;
                trace.push(TraceEvent {
                    step: self.step,
                    action: a,
                    start_us: started,
                    dur_us: now - started,
                    recomputed,
                    wait_us: (self.waited_ns.load(std::sync::atomic::Ordering::Relaxed)
                        - waited_before) as f64
                        / 1e3,
                });
            }
        }
        for s in sends {
            s.wait()?;
        }
        if let Some(n) = self.queue.as_ref().map(|q| q.pending()).filter(|n| *n > 0) {
            return Err(leftover(n));
        }
        for (_, stage) in &self.chunks {
            stage.finish_batch()?;
        }
        self.sum_tied(&mut grads)?;
        // Every rank reports the batch loss (only the last stage computed it).
        let l = Tensor::new(&[loss], &candle_core::Device::Cpu)?;
        let loss = self.comm.all_reduce(&l, ReduceOp::Sum)?.to_vec1::<f64>()?[0];
        Ok((loss, grads))
    }

    /// Sums the gradients of each tied pair between the ranks that own its members, first
    /// member's gradient plus second's on both, so both stay bit-equal.
    fn sum_tied(&self, grads: &mut Grads) -> Result<()> {
        for (i, (a, b)) in self.opts.tied.iter().enumerate() {
            let (ra, rb) = (self.owner_of(a)?, self.owner_of(b)?);
            let me = self.comm.rank();
            let tag = MAX_TAG - 1 - i as u64;
            if ra == rb {
                if me == ra {
                    if let (Some(ga), Some(gb)) = (grads.get(a), grads.get(b)) {
                        let s = (ga + gb)?;
                        grads.insert(a.clone(), s.clone());
                        grads.insert(b.clone(), s);
                    }
                }
            } else if me == ra {
                let ga = grads
                    .get(a)
                    .cloned()
                    .ok_or_else(|| invalid!("no gradient for tied `{a}`"))?;
                self.comm.send(&ga, rb, tag)?;
                let gb = self.comm.recv(rb, tag)?;
                grads.insert(a.clone(), (ga + gb)?);
            } else if me == rb {
                let gb = grads
                    .get(b)
                    .cloned()
                    .ok_or_else(|| invalid!("no gradient for tied `{b}`"))?;
                let ga = self.comm.recv(ra, tag)?;
                self.comm.send(&gb, ra, tag)?;
                grads.insert(b.clone(), (ga + gb)?);
            }
        }
        Ok(())
    }

    /// The pipeline rank that owns parameter `name` (every rank knows every stage's layers).
    fn owner_of(&self, name: &str) -> Result<usize> {
        let here = self.params.iter().any(|(n, _)| n == name);
        let flag = Tensor::new(
            &[if here { self.comm.rank() as i64 + 1 } else { 0 }],
            &candle_core::Device::Cpu,
        )?;
        let r = self
            .comm
            .all_reduce(&flag, ReduceOp::Max)?
            .to_vec1::<i64>()?[0];
        if r == 0 {
            return Err(invalid!(
                "tied parameter `{name}` is not a parameter of the model"
            ));
        }
        Ok(r as usize - 1)
    }

    /// Varuna's `evaluate`: the evaluation-mode output of the whole model for a batch, on every
    /// rank (see [`Pipeline::predict`]).
    pub fn evaluate(&self, inputs: &Tensor) -> Result<Tensor> {
        self.predict(inputs)
    }

    /// Evaluation-mode logits of the whole model for `inputs` (one batch, no micro-batches),
    /// on every rank: the stages run in turn and the last one's output is gathered to all.
    pub fn predict(&self, inputs: &Tensor) -> Result<Tensor> {
        let last = self.stages() - 1;
        let base = 2 * self.stages() * self.schedule.micro_batches;
        let mut out = None;
        for (k, stage) in &self.chunks {
            let k = *k;
            let x = if k == 0 {
                inputs.clone()
            } else {
                self.comm.recv(self.rank_of(k - 1), (base + k - 1) as u64)?
            };
            let m = self.schedule.micro_batches;
            let imports = self.import_skips(k, m)?;
            let mut cx = Cx::eval();
            let (y, exports) = self.run_stage(stage, k, &x, &imports, &mut cx)?;
            for (i, t) in &exports {
                let to = self.rank_of(self.routes[*i].to);
                self.comm.send(t, to, self.skip_tag(m, *i, false))?;
            }
            if k == last {
                out = Some(whole_output(&y, &cx, &self.tp)?);
            } else {
                self.comm.send(&y, self.rank_of(k + 1), (base + k) as u64)?;
            }
        }
        // Ranks without the last stage contribute an empty tensor of the logits' dtype.
        let mine = match out {
            Some(y) => y,
            None => Tensor::zeros(0, DType::F32, &candle_core::Device::Cpu)?,
        };
        let mut all = self.comm.all_gather(&mine)?;
        Ok(all.swap_remove(self.rank_of(last)))
    }

    /// The global gradient norm of the model the pipeline holds, from this rank's `grads`
    /// (collective over the pipeline and the tensor-parallel group): each tied pair and each
    /// whole parameter counted once, each shard once.
    pub fn grad_norm(&self, grads: &Grads) -> Result<f64> {
        let sq = sum_sq_share(grads, &self.opts.tied, &self.sharded, self.tp.rank())?;
        let sq = self.comm.all_reduce(
            &Tensor::new(&[sq], &candle_core::Device::Cpu)?,
            ReduceOp::Sum,
        )?;
        let sq = self.tp.all_reduce(&sq, ReduceOp::Sum)?;
        Ok(sq.to_vec1::<f64>()?[0].max(0.0).sqrt())
    }

    /// Advances the step counter without an optimizer step (a step skipped on overflow keeps
    /// its number, so this is for wrappers that step the optimizer themselves).
    pub fn finish_step(&mut self) {
        self.step += 1;
    }

    /// Steps taken.
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// One optimizer step on a batch.
    pub fn step(&mut self, inputs: &Tensor, targets: &Tensor) -> Result<StepReport> {
        let (loss, mut grads) = self.loss_and_grads(inputs, targets)?;
        if !loss.is_finite() {
            return Err(Error::NonFiniteLoss {
                step: self.step,
                loss,
            });
        }
        let grad_norm = self.grad_norm(&grads)?;
        if let Some(max) = self.opts.clip {
            scale_to_norm(&mut grads, grad_norm, max)?;
        }
        let lr = self.opts.lr.lr_at(self.step);
        self.optimizer
            .as_mut()
            .ok_or_else(|| invalid!("the pipeline has no optimizer: call set_optimizer first"))?
            .step(&grads, lr)?;
        let report = StepReport {
            step: self.step,
            loss,
            grad_norm,
            lr,
            targets: count_targets(targets)?,
        };
        self.step += 1;
        Ok(report)
    }
}

impl crate::serial::Trainer for Pipeline {
    fn step(&mut self, inputs: &Tensor, targets: &Tensor) -> Result<StepReport> {
        Pipeline::step(self, inputs, targets)
    }

    fn predict(&self, inputs: &Tensor) -> Result<Tensor> {
        Pipeline::predict(self, inputs)
    }
}

/// A Chrome trace (Perfetto, chrome://tracing): one track per pipeline stage, one event per
/// action named F, B (or R+B when recomputed), I or W with the micro-batch.
pub fn chrome_trace(per_stage: &[Vec<TraceEvent>]) -> String {
    let mut events = Vec::new();
    for (stage, evs) in per_stage.iter().enumerate() {
        events.push(serde_json::json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": stage,
            "args": {"name": format!("stage {stage}")}
        }));
        for e in evs {
            let name = if e.recomputed {
                format!("R+{}", e.action)
            } else {
                e.action.to_string()
            };
            events.push(serde_json::json!({
                "name": name, "cat": e.action.letter().to_string(), "ph": "X", "pid": 0, "tid": stage,
                "ts": e.start_us, "dur": e.dur_us,
                "args": {"step": e.step, "micro_batch": e.action.mb(), "chunk": e.action.chunk()}
            }));
        }
    }
    serde_json::json!({"traceEvents": events, "displayTimeUnit": "ms"}).to_string()
}
