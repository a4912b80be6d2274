//! Serial training on one device: the oracle every parallel layout must reproduce.
//!
//! A batch is split into `chunks` micro-batches (gradient accumulation); each micro-batch's
//! summed loss is divided by the number of counted targets of the *whole* batch, so the
//! accumulated gradient is the gradient of the whole batch's mean loss whatever the split.
//! Tied parameter pairs have their gradients summed and both members updated with the sum, so
//! they start and stay equal.
//!
//! A model built with a tensor-parallel group ([`crate::model::Build::with_tp`]) trains here too,
//! one trainer per rank of the group: the loss is vocabulary-parallel when the logits are
//! split, and the gradient norm counts every sharded parameter once over the group.

use candle_core::{DType, Tensor, Var};

use std::path::{Path, PathBuf};

use crate::distributed::comm::ReduceOp;
use crate::engine::checkpoint::{self, CheckpointOptions, Header, Owned, Reader};
use crate::engine::spec::TrainSpec;
use crate::model::batch::Batch;
use crate::model::expert_load::{merge, sort_by_layer, ExpertLoad};
use crate::model::nn::optim::{scale_to_norm, Optimizer};
use crate::model::nn::{sum_sq_share, Grads};
use crate::model::{Activation, Cx, Mode, Stage};
use crate::parallel::loss::SharedLoss;
use crate::parallel::tensor_parallel::whole_output;
use crate::{invalid, Error, Result};

/// Options of a [`SerialTrainer`]: the run it is the oracle of, how many micro-batches a batch
/// splits into, the tied pairs and the objective.
#[derive(Clone)]
pub struct TrainOptions {
    /// The run: its seed (initialisation and dropout), learning rate and clipping (`optim`;
    /// the optimizer itself is the trainer's argument) and deferred batch norm (`pipeline`).
    /// Its layout, batch sizes, schedule, precision and cadence are not read here.
    pub spec: TrainSpec,
    /// Micro-batches each batch splits into (gradients accumulate over them).
    pub micro_batches: usize,
    /// Parameter pairs kept equal (GPT's `wte.weight` and `lm_head.weight`).
    pub tied: Vec<(String, String)>,
    /// The objective (see [`crate::parallel::loss`]).
    pub loss: SharedLoss,
}

impl TrainOptions {
    /// The serial trainer's options for the run `spec` describes (whatever its layout): every
    /// micro-batch of its global batch, with the tied pairs `tied` and the objective `loss`.
    pub fn of(spec: &TrainSpec, tied: Vec<(String, String)>, loss: SharedLoss) -> Self {
        Self {
            spec: spec.clone(),
            micro_batches: spec.batch.global_batch / spec.batch.micro_batch.max(1),
            tied,
            loss,
        }
    }
}

/// What one optimizer step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// The step's number.
    pub step: u64,
    /// The batch's mean loss.
    pub loss: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    /// The learning rate it used.
    pub lr: f64,
    /// Counted targets (tokens or samples) in the batch.
    pub targets: usize,
}

/// Trains a built model on one device.
pub struct SerialTrainer {
    model: Stage,
    params: Vec<(String, Var)>,
    /// Names of the tensor-parallel (sharded) parameters.
    sharded: Vec<String>,
    optimizer: Box<dyn Optimizer>,
    opts: TrainOptions,
    step: u64,
    /// What the mixtures of experts routed in the last batch's forwards.
    loads: std::sync::Mutex<Vec<ExpertLoad>>,
}

impl SerialTrainer {
    /// A trainer of `model` with `optimizer` (the whole model on one device).
    pub fn new(model: Stage, optimizer: Box<dyn Optimizer>, opts: TrainOptions) -> Result<Self> {
        opts.spec.optim.lr.validate()?;
        // One rank with the machine's cores, unless the user or a launcher said otherwise.
        crate::distributed::comm::size_thread_pools(1);
        if opts.micro_batches == 0 {
            return Err(invalid!("chunks must be at least 1"));
        }
        let params = model.params();
        for (a, b) in &opts.tied {
            let va = find(&params, a)?;
            let vb = find(&params, b)?;
            if va.dims() != vb.dims() {
                return Err(invalid!(
                    "tied parameters `{a}` {:?} and `{b}` {:?} differ in shape",
                    va.dims(),
                    vb.dims()
                ));
            }
        }
        Ok(Self {
            sharded: crate::parallel::tensor_parallel::register_ddp_parameters_to_ignore(&model),
            model,
            params,
            optimizer,
            opts,
            step: 0,
            loads: Default::default(),
        })
    }

    /// What each mixture of experts routed over the last batch's micro-batches, layer by
    /// layer in model order (empty without mixtures).
    pub fn expert_loads(&self) -> Vec<ExpertLoad> {
        self.loads.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The model.
    pub fn model(&self) -> &Stage {
        &self.model
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &dyn Optimizer {
        self.optimizer.as_ref()
    }

    /// The optimizer, to change (load its state).
    pub fn optimizer_mut(&mut self) -> &mut dyn Optimizer {
        self.optimizer.as_mut()
    }

    /// Steps taken.
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// Sets the step counter (when resuming).
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// Loss of the whole batch and the gradient of every parameter (tied pairs summed), without
    /// stepping the optimizer; also the count the loss averages over.
    pub fn loss_and_grads(&self, batch: &Batch) -> Result<(f64, Grads, usize)> {
        let total = self.opts.loss.count(batch)?;
        if total == 0 {
            return Err(invalid!(
                "the batch has no counted target: every target is ignored"
            ));
        }
        let mut grads = Grads::new();
        let mut loss = 0.0;
        let mut loads = Vec::new();
        for (i, mb) in batch
            .split(self.opts.micro_batches)?
            .into_iter()
            .enumerate()
        {
            let mut cx = Cx::new(Mode::Train, self.opts.spec.seed, self.step, i);
            cx.defer_batch_stats = self.opts.spec.pipeline.deferred_batch_norm;
            cx.aux_weight = 1.0 / self.opts.micro_batches as f64;
            let out = self.forward_cx(&mb, &mut cx)?;
            merge(&mut loads, std::mem::take(&mut cx.expert_loads));
            let (sum, _) = self.opts.loss.sum(&out, &mb, &cx, self.model.tp())?;
            let l = (sum / total as f64)?;
            loss += l.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            let store = l.backward()?;
            grads.accumulate(Grads::from_store(&store, &self.params)?)?;
        }
        self.model.finish_batch()?;
        sort_by_layer(&mut loads);
        *self.loads.lock().unwrap_or_else(|e| e.into_inner()) = loads;
        for (a, b) in &self.opts.tied {
            let sum = match (grads.get(a), grads.get(b)) {
                (Some(ga), Some(gb)) => (ga + gb)?,
                (Some(g), None) | (None, Some(g)) => g.clone(),
                (None, None) => continue,
            };
            grads.insert(a.clone(), sum.clone());
            grads.insert(b.clone(), sum);
        }
        Ok((loss, grads, total))
    }

    /// One optimizer step on a batch.
    pub fn step(&mut self, batch: &Batch) -> Result<StepReport> {
        let (loss, mut grads, total) = self.loss_and_grads(batch)?;
        if !loss.is_finite() {
            return Err(Error::NonFiniteLoss {
                step: self.step,
                loss,
            });
        }
        let tp = self.model.tp();
        let share = sum_sq_share(&grads, &self.opts.tied, &self.sharded, tp.rank())?;
        let sq = tp.all_reduce(
            &Tensor::new(&[share], &candle_core::Device::Cpu)?,
            ReduceOp::Sum,
        )?;
        let grad_norm = sq.to_vec1::<f64>()?[0].max(0.0).sqrt();
        if let Some(max) = self.opts.spec.optim.clip {
            scale_to_norm(&mut grads, grad_norm, max)?;
        }
        let lr = self.opts.spec.optim.lr.lr_at(self.step);
        self.optimizer.step(&grads, lr)?;
        let report = StepReport {
            step: self.step,
            loss,
            grad_norm,
            lr,
            targets: total,
        };
        self.step += 1;
        Ok(report)
    }

    fn owned(&self) -> Owned<'_> {
        let tp = self.model.tp();
        Owned {
            rank: tp.rank(),
            params: &self.params,
            shards: self.model.shards(),
            buffers: self.model.buffers(),
            write_whole: tp.rank() == 0,
            write_shards: true,
            experts: Vec::new(),
            write_experts: false,
            write_expert_shards: false,
        }
    }

    /// Saves the model, optimizer state and step into `<root>/step-NNNNNNNN` in the format of
    /// [`crate::engine::checkpoint`] (the 1 x 1 x 1 case of a Varuna checkpoint; collective over the
    /// tensor-parallel group when the model is split).
    pub fn checkpoint(&self, root: &Path, opts: &CheckpointOptions) -> Result<PathBuf> {
        let o = self.owned();
        let state = self.optimizer.state_dict()?;
        let optimizer_step = match state.get("step") {
            Some(t) => t.flatten_all()?.to_vec1::<i64>()?[0] as u64,
            None => 0,
        };
        let tp = self.model.tp();
        let header = Header {
            layout: crate::distributed::topology::Layout::new(1, tp.size(), 1)?,
            precision: "f32".into(),
            world: tp.size(),
            step: self.step,
            state: serde_json::json!({
                "step": self.step,
                "optimizer_step": optimizer_step,
                "lr_schedule": self.opts.spec.optim.lr,
                "loss_scaler": null,
                "seed": self.opts.spec.seed,
                "extra": opts.extra,
            }),
            meta: opts.meta.clone(),
            keep: opts.keep,
        };
        checkpoint::save_now(
            tp.comm(),
            root,
            header,
            o.snapshot(&self.optimizer.state_dict()?)?,
        )
    }

    /// Loads a checkpoint saved from any layout (see [`crate::engine::checkpoint`]) and returns the
    /// step training goes on from.
    pub fn load_checkpoint(&mut self, path: &Path) -> Result<u64> {
        let r = Reader::open(path)?;
        let o = self.owned();
        if self.model.tp().size() == 1 {
            r.check_model(&o.param_shapes())?;
        }
        let field = |k: &str| {
            r.state()[k].as_u64().ok_or_else(|| {
                Error::State(format!("`{}`: state.json has no `{k}`", r.dir().display()))
            })
        };
        let (step, optimizer_step) = (field("step")?, field("optimizer_step")?);
        let restored = o.read(&r, optimizer_step)?;
        restored.apply(|s| self.optimizer.load_state_dict(s))?;
        self.step = step;
        Ok(step)
    }

    /// Evaluation-mode output of the whole model for `batch`'s inputs (no dropout, running
    /// statistics); split logits are gathered.
    pub fn predict(&self, batch: &Batch) -> Result<Tensor> {
        let mut cx = Cx::eval();
        let out = self.forward_cx(batch, &mut cx)?;
        whole_output(&out.into_tensor("model output")?, &cx, self.model.tp())
    }

    /// Evaluation-mode mean loss of `batch` (one pass, no micro-batches) and the whole output.
    pub fn evaluate(&self, batch: &Batch) -> Result<(f64, Tensor)> {
        let mut cx = Cx::eval();
        let out = self.forward_cx(batch, &mut cx)?;
        let (sum, count) = self.opts.loss.sum(&out, batch, &cx, self.model.tp())?;
        if count == 0 {
            return Err(invalid!(
                "the batch has no counted target: every target is ignored"
            ));
        }
        let loss = sum.to_dtype(DType::F64)?.to_scalar::<f64>()? / count as f64;
        let out = whole_output(&out.into_tensor("model output")?, &cx, self.model.tp())?;
        Ok((loss, out))
    }

    fn forward_cx(&self, batch: &Batch, cx: &mut Cx) -> Result<Activation> {
        let x = Activation::from_batch(batch, self.model.input_names(), "the model")?;
        let out = self.model.forward(x, cx)?;
        let left = cx.stashed();
        if !left.is_empty() {
            return Err(invalid!(
                "skip connections {left:?} were stashed but never popped"
            ));
        }
        Ok(out)
    }
}

/// The global gradient norm with each tied pair counted once (it is one parameter in
/// PyTorch), and clipping to `clip` if given. Returns the norm before clipping.
pub fn clip_tied(grads: &mut Grads, tied: &[(String, String)], clip: Option<f64>) -> Result<f64> {
    let norm = sum_sq_share(grads, tied, &[], 0)?.sqrt();
    if let Some(max) = clip {
        scale_to_norm(grads, norm, max)?;
    }
    Ok(norm)
}

fn find<'a>(params: &'a [(String, Var)], name: &str) -> Result<&'a Var> {
    params
        .iter()
        .find_map(|(n, v)| (n == name).then_some(v))
        .ok_or_else(|| invalid!("tied parameter `{name}` is not a parameter of the model"))
}
