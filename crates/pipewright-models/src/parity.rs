//! The oracle check of a layout: a small GPT on the adder task trained serially (the separate
//! [`SerialTrainer`]) and by one rank of a [`Varuna`] job, compared step by step: the loss,
//! the gradient norm, every parameter's summed gradient (its part on this rank: a
//! tensor-parallel shard, a ZeRO piece) and every parameter after the run. The tests run it on
//! local threads; `examples/layout_parity.rs` runs it under `mpirun`.

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{Device, Tensor, Var};
use pipewright::distributed::comm::Communicator;
use pipewright::distributed::topology::Layout;
use pipewright::engine::serial::{SerialTrainer, TrainOptions};
use pipewright::engine::spec::TrainSpec;
use pipewright::engine::varuna::{Varuna, VarunaOptions};
use pipewright::model::nn::max_rel_diff;
use pipewright::model::nn::optim::{AdamW, AdamWConfig, LrSchedule, Optimizer, Sgd, SgdConfig};
use pipewright::parallel::data_parallel::ReplicaBatches;
use pipewright::parallel::loss::CrossEntropy;
use pipewright::parallel::tensor_parallel::{part, Shard};
use pipewright::{invalid, Batch, Build, Result};

use crate::tasks::Adder;
use crate::{gpt, GptConfig, Task, TIED};

/// The run both sides make.
#[derive(Clone, Debug)]
pub struct ParityRun {
    /// The model.
    pub gpt: GptConfig,
    /// The seed of initialisation and data.
    pub seed: u64,
    /// Rows of a step over all replicas.
    pub global_batch: usize,
    /// Rows of a micro-batch.
    pub micro_batch: usize,
    /// Steps to take.
    pub steps: u64,
    /// At 1e-3 AdamW's per-element division keeps the last-bit differences of other summation
    /// orders (tensor- and data-parallel sums) well inside 1e-5.
    pub lr: f64,
    /// Small enough that clipping acts on every step.
    pub clip: f64,
    /// Digits of the adder task's numbers: sequences of `3 * digits` tokens (2: 6 tokens; 8:
    /// 24, which splits over a context-parallel ring of 2, 3 or 4).
    pub digits: usize,
    /// The optimizer both sides step with.
    pub update: Update,
    /// A deliberate error, to show that the comparison catches it: this parameter's gradient
    /// times this factor on every rank of the parallel run that holds it, before the sums
    /// over replicas (under ZeRO-2/3, on the pieces after them).
    pub perturb: Option<(String, f64)>,
}

/// The optimizer of a [`ParityRun`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Update {
    /// AdamW (PyTorch's defaults): its per-element division barely reacts to a gradient's
    /// scale, so the parameters after it check little of the gradients: they are compared
    /// one by one as well.
    AdamW,
    /// Plain SGD (no momentum, no weight decay): each parameter moves by its gradient alone.
    Sgd,
}

impl Default for ParityRun {
    fn default() -> Self {
        Self {
            gpt: GptConfig {
                vocab_size: 16,
                block_size: 6,
                n_layer: 3,
                n_head: 4,
                n_embd: 16,
                dropout: 0.1,
            },
            seed: 9,
            global_batch: 16,
            micro_batch: 2,
            steps: 5,
            lr: 1e-3,
            clip: 0.05,
            digits: 2,
            update: Update::AdamW,
            perturb: None,
        }
    }
}

/// (loss, gradient norm) of every step, every step's gradients and the final parameters of
/// the serial run.
pub struct SerialResult {
    /// (loss, gradient norm) of each step.
    pub steps: Vec<(f64, f64)>,
    /// Each step's gradients (before clipping; tied pairs summed), by name.
    pub grads: Vec<HashMap<String, Tensor>>,
    /// Parameters after the last step.
    pub params: HashMap<String, Tensor>,
}

/// What one rank of the parallel run saw: (loss, norm, overflow) per step, its parameters
/// and how its sharded ones are split, and its gradients.
#[derive(Clone)]
pub struct RankResult {
    /// (loss, gradient norm, overflow) of each step.
    pub steps: Vec<(f64, f64, bool)>,
    /// This rank's parameters after the last step.
    pub params: Vec<(String, Tensor)>,
    /// How each of its sharded parameters is split.
    pub shards: HashMap<String, Shard>,
    /// Each step's gradients as its optimizer stepped from them (before clipping).
    pub grads: Vec<StepGrads>,
    /// Under ZeRO, the flattened elements of each (tensor-parallel part of a) parameter
    /// whose gradient this rank holds; empty without ZeRO.
    pub pieces: HashMap<String, Range<usize>>,
    /// The step `grads` start at (a resumed run's first).
    pub first_step: usize,
}

impl RankResult {
    /// What the rank of `v` ends with: `steps` (loss, norm, overflow) from `first_step` on,
    /// whose gradients `log` kept, and `params`. An error unless each step's gradients are
    /// those of every parameter, or ZeRO piece, that the rank's optimizer holds.
    pub fn of(
        v: &Varuna,
        steps: Vec<(f64, f64, bool)>,
        params: Vec<(String, Tensor)>,
        log: &GradLog,
        first_step: usize,
    ) -> Result<Self> {
        let pieces: HashMap<String, Range<usize>> = v
            .zero_pieces()
            .into_iter()
            .map(|p| (p.name, p.elems))
            .collect();
        let mut held: Vec<String> = if pieces.is_empty() {
            v.pipeline()
                .params()
                .iter()
                .map(|(n, _)| n.clone())
                .collect()
        } else {
            pieces.keys().cloned().collect()
        };
        held.sort();
        let grads = log.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for (s, g) in grads.iter().enumerate() {
            let mut names: Vec<String> = g.iter().map(|(n, _)| n.clone()).collect();
            names.sort();
            if names != held {
                return Err(invalid!(
                    "step {}: gradients of {names:?}, but the rank holds {held:?}",
                    first_step + s
                ));
            }
        }
        Ok(Self {
            steps,
            params,
            shards: v.pipeline().shards().into_iter().collect(),
            grads,
            pieces,
            first_step,
        })
    }

    /// This rank's tensor-parallel shard of the serial tensor `whole` of parameter `name`
    /// (all of it when the parameter is not split).
    pub fn shard(&self, name: &str, whole: &Tensor) -> Result<Tensor> {
        Ok(match self.shards.get(name) {
            Some(s) => part(whole, s.axis, s.stride, s.index, s.count)?,
            None => whole.clone(),
        })
    }

    /// This rank's part of the serial gradient `whole` of parameter `name`, flattened: its
    /// shard, and of that its ZeRO piece when it holds one.
    pub fn grad_part(&self, name: &str, whole: &Tensor) -> Result<Tensor> {
        let w = self.shard(name, whole)?.flatten_all()?;
        Ok(match self.pieces.get(name) {
            Some(r) => w.narrow(0, r.start, r.len())?,
            None => w,
        })
    }
}

impl Update {
    /// The optimizer over `params`.
    pub fn make(self, params: Vec<(String, Var)>) -> Result<Box<dyn Optimizer>> {
        Ok(match self {
            Update::AdamW => Box::new(AdamW::new(params, AdamWConfig::default())?),
            Update::Sgd => Box::new(Sgd::new(params, SgdConfig::default())?),
        })
    }
}

fn tied() -> Vec<(String, String)> {
    vec![(TIED.0.into(), TIED.1.into())]
}

impl ParityRun {
    /// The serial oracle: the same micro-batches (global batch / chunk size of them).
    pub fn serial(&self) -> Result<SerialResult> {
        let task = Adder::new(self.digits, 0)?;
        let stage = gpt(self.gpt)?.build(&Build::cpu(self.seed))?;
        let opt = self.update.make(stage.params())?;
        let opts = self.options(Layout::serial());
        let options = TrainOptions::of(&opts.spec, tied(), opts.loss);
        let mut t = SerialTrainer::new(stage, opt, options)?;
        let (mut steps, mut grads) = (Vec::new(), Vec::new());
        for s in 0..self.steps {
            let (x, y) = task.batch(s, self.global_batch)?;
            let batch = Batch::pair(x, y);
            // The step's gradients, computed as the step computes them (the same draws).
            let (_, g, _) = t.loss_and_grads(&batch)?;
            grads.push(g.iter().map(|(n, g)| (n.clone(), g.clone())).collect());
            let r = t.step(&batch)?;
            steps.push((r.loss, r.grad_norm));
        }
        let params = t
            .model()
            .params()
            .into_iter()
            .map(|(n, v)| Ok((n, v.as_tensor().copy()?)))
            .collect::<Result<_>>()?;
        Ok(SerialResult {
            steps,
            grads,
            params,
        })
    }

    /// The Varuna options of this run for `layout`.
    pub fn options(&self, layout: Layout) -> VarunaOptions {
        let mut spec = TrainSpec::new(layout, self.global_batch, self.micro_batch, 1);
        spec.seed = self.seed;
        spec.optim.clip = Some(self.clip);
        spec.optim.lr = LrSchedule::Constant { lr: self.lr };
        VarunaOptions {
            shared_weights: tied(),
            ..VarunaOptions::of(spec)
        }
    }

    /// The run at context-parallel sizes: sequences of 24 tokens (8-digit sums) and no dropout
    /// (context parallelism runs without it).
    pub fn for_context_parallel() -> Self {
        let base = Self::default();
        Self {
            gpt: GptConfig {
                block_size: 24,
                dropout: 0.0,
                ..base.gpt
            },
            digits: 8,
            ..base
        }
    }

    /// One rank of the parallel run (every rank of `world` calls it).
    pub fn rank(&self, world: Box<dyn Communicator>, opts: VarunaOptions) -> Result<RankResult> {
        let task = Adder::new(self.digits, 0)?;
        let mut v = Varuna::new(&gpt(self.gpt)?, world, opts)?;
        let update = self.update;
        v.set_optimizer(|p| update.make(p))?;
        let grads = watch(&mut v, self.perturb.clone());
        let loader = ReplicaBatches::new(
            |s, n| task.batch(s, n).map(|(x, y)| Batch::pair(x, y)),
            self.global_batch,
            v.coords().dp_rank,
            v.topology().layout().dp,
            Device::Cpu,
        )?;
        let mut steps = Vec::new();
        for s in 0..self.steps {
            let o = v.step(&loader.batch(s)?)?;
            steps.push((o.loss, o.grad_norm, o.overflow));
        }
        RankResult::of(&v, steps, v.parameters()?, &grads, 0)
    }
}

/// One step's gradients by name.
pub type StepGrads = Vec<(String, Tensor)>;

/// Every step's summed gradients of a rank, as [`watch`] keeps them.
#[derive(Clone, Default)]
pub struct GradLog(std::sync::Arc<std::sync::Mutex<Vec<StepGrads>>>);

/// Keeps every step's summed gradients of `v` (each as its optimizer steps from them), and
/// makes the deliberate error `perturb` (see [`ParityRun::perturb`]).
pub fn watch(v: &mut Varuna, perturb: Option<(String, f64)>) -> GradLog {
    let log = GradLog::default();
    let keep = log.clone();
    v.set_summed_grad_hook(move |g| {
        let step = g.iter().map(|(n, t)| (n.clone(), t.clone())).collect();
        keep.0.lock().unwrap_or_else(|e| e.into_inner()).push(step);
    });
    if let Some((name, factor)) = perturb {
        v.set_grad_hook(move |g| {
            if let Some(t) = g.get(&name) {
                let scaled = t.affine(factor, 0.0).expect("scaling an f32 gradient");
                g.insert(name.clone(), scaled);
            }
        });
    }
    log
}

/// How far a context-parallel layout's parameters may end from the serial run's (relative;
/// 1e-5 for other layouts; losses and gradient norms agree within 1e-7). The softmax makes the key gradients of a query row sum to
/// zero, so the part of a pre-attention LayerNorm bias's gradient that comes through the keys
/// is zero in exact arithmetic and rounding noise in f32; ring attention's backward recomputes
/// the probabilities block by block (it keeps no scores) and rounds that noise differently
/// from the serial kernel, and AdamW's per-element division turns it into a visible step on a
/// bias whose gradient is small: measured 1.6e-5 to 2.8e-5 on `h.1.ln_1.bias` at cp 2 and 4,
/// every other tensor within 5e-6. The ring itself equals causal attention within 1e-12 in f64
/// (`pipewright/tests/ring_attention.rs`).
pub const CONTEXT_PARALLEL_TOLERANCE: f64 = 4e-5;

/// The largest relative difference between a rank's run and the serial one (losses, norms,
/// and every parameter against the serial parameter's matching part); an error if a step
/// overflowed, clipping did not act, or a parameter is missing.
pub fn worst_difference(got: &RankResult, want: &SerialResult) -> Result<f64> {
    let mut worst = 0.0f64;
    if got.steps.len() != want.steps.len() {
        return Err(invalid!(
            "{} steps against {}",
            got.steps.len(),
            want.steps.len()
        ));
    }
    for (i, ((l, n, o), (wl, wn))) in got.steps.iter().zip(&want.steps).enumerate() {
        if *o {
            return Err(invalid!("step {i} overflowed"));
        }
        if *wn <= 0.0 || !n.is_finite() {
            return Err(invalid!("step {i}: gradient norm {n} against {wn}"));
        }
        worst = worst.max(((l - wl) / wl).abs()).max(((n - wn) / wn).abs());
    }
    for (name, p) in &got.params {
        let w = want
            .params
            .get(name)
            .ok_or_else(|| invalid!("`{name}` is not a parameter of the serial model"))?;
        worst = worst.max(max_rel_diff(p, &got.shard(name, w)?)?);
    }
    Ok(worst.max(worst_gradient(got, want)?.0))
}

/// The largest relative difference between a rank's gradients and the serial ones' parts,
/// over every step it kept and every parameter, and where it is (step, name).
pub fn worst_gradient(got: &RankResult, want: &SerialResult) -> Result<(f64, String)> {
    if got.first_step + got.grads.len() != want.grads.len() || got.grads.is_empty() {
        return Err(invalid!(
            "gradients of {} steps from step {} against {}",
            got.grads.len(),
            got.first_step,
            want.grads.len()
        ));
    }
    let mut worst = (0.0f64, String::new());
    let serial = &want.grads[got.first_step..];
    for (i, (mine, serial)) in got.grads.iter().zip(serial).enumerate() {
        let step = got.first_step + i;
        for (name, g) in mine {
            let w = serial
                .get(name)
                .ok_or_else(|| invalid!("step {step}: the serial run has no gradient `{name}`"))?;
            let d = max_rel_diff(&g.flatten_all()?, &got.grad_part(name, w)?)?;
            if d > worst.0 || worst.1.is_empty() {
                worst = (d, format!("step {step} `{name}`"));
            }
        }
    }
    Ok(worst)
}

/// The losses of `spec`'s run trained by the separate serial trainer (which shares none of
/// the parallel step's code): the same model, seed, task batches, micro-batches, optimizer,
/// learning rate and clipping, whatever layout the spec gives. The oracle `pipewright train`'s
/// runs are held to (`tools/mpi_parity.sh`, the command's tests), where a run at one rank would
/// be the engine under test.
pub fn serial_losses(spec: &crate::RunSpec) -> Result<Vec<f64>> {
    use pipewright::trainer::model_spec::ModelSpec;
    let t = &spec.train;
    let task = spec.task.build(t.seed)?;
    let stage = spec.model.build()?.build(&Build::cpu(t.seed))?;
    let tied = spec.model.tied();
    let opt = t.optimizer(stage.params(), &tied)?;
    let options = TrainOptions::of(t, tied, std::sync::Arc::new(CrossEntropy::default()));
    let mut trainer = SerialTrainer::new(stage, opt, options)?;
    (0..t.cadence.steps)
        .map(|s| {
            let (x, y) = task.batch(s, t.batch.global_batch)?;
            Ok(trainer.step(&Batch::pair(x, y))?.loss)
        })
        .collect()
}
