//! pystematic's example as a pipewright experiment: a small classifier of 2-D points (a tanh
//! layer, a cut, a sigmoid read-out), binary cross-entropy, SGD, a data set read through the
//! `SmartDataLoader`, and a `Context` that saves the trainer, the loader's position (its epoch
//! too) and the recorder's count together, so that `--checkpoint` goes on exactly where a run
//! stopped. It trains through the front door (`pipewright::trainer`), its hooks giving the
//! loader's batches.
//!
//! ```sh
//! cargo run --release -p pipewright --example experiment -- --help
//! cargo run --release -p pipewright --example experiment -- --epochs 4 --lr 0.5
//! cargo run --release -p pipewright --example experiment -- --distributed --nproc-per-node 4 --pp 2
//! ```
//!
//! Each run writes `<output_dir>/points/<date>-<time>-<id>/`: `parameters.json`, `losses.csv`
//! (step, epoch, loss) and `result.json` (every step's loss and the final held-out loss).

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use pipewright::distributed::topology::Layout;
use pipewright::experiment::{Context, Dataset, Experiment, Param, Recorder, SmartDataLoader};
use pipewright::model::nn::optim::{LrSchedule, OptimSpec, OptimizerConfig, SgdConfig};
use pipewright::model::nn::{Linear, Module};
use pipewright::model::{Activation, Cx, Layer, LayerSpec, Sequential};
use pipewright::parallel::loss::Loss;
use pipewright::parallel::tensor_parallel::Group;
use pipewright::runtime::seed::rng_for;
use pipewright::trainer::model_spec::Custom;
use pipewright::trainer::{Cadence, Hooks, Run, StepDone, TrainSpec, Trainer};
use pipewright::{invalid, Batch, Build, Error, Result};
use rand::Rng;

/// Hidden width of the classifier.
const HIDDEN: usize = 8;

/// Points uniform in the square [-1, 1]^2, labelled 1 above the line x + y / 2 = 0.1: sample
/// `i` is a pure function of the seed and `i`.
pub struct Points {
    len: usize,
    seed: u64,
}

impl Points {
    pub fn new(len: usize, seed: u64) -> Self {
        Self { len, seed }
    }
}

impl Dataset for Points {
    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, index: usize) -> Result<Batch> {
        if index >= self.len {
            return Err(invalid!("point {index} of {}", self.len));
        }
        let mut rng = rng_for(self.seed, &format!("point {index}"));
        let (x, y): (f32, f32) = (rng.random_range(-1.0..1.0), rng.random_range(-1.0..1.0));
        let label = f32::from(u8::from(x + 0.5 * y > 0.1));
        Ok(Batch::new()
            .with("x", Tensor::new(&[[x, y]], &Device::Cpu)?)
            .with("y", Tensor::new(&[[label]], &Device::Cpu)?))
    }
}

/// A linear layer and an activation.
struct Dense(
    Linear,
    fn(&Tensor) -> candle_core::Result<Tensor>,
    &'static str,
);

impl Layer for Dense {
    fn name(&self) -> &str {
        self.2
    }

    fn forward(&self, x: Activation, _cx: &mut Cx) -> Result<Activation> {
        Ok((self.1)(&self.0.forward(&x.into_tensor(self.2)?)?)?.into())
    }

    fn params(&self) -> Vec<(String, Var)> {
        self.0.params()
    }
}

fn sigmoid(t: &Tensor) -> candle_core::Result<Tensor> {
    (t.neg()?.exp()? + 1.0)?.recip()
}

/// tanh(W1 x + b1) | cut | sigmoid(W2 h + b2).
pub fn model() -> Sequential {
    let mut m = Sequential::new();
    m.inputs(&["x"]);
    m.push(LayerSpec::new("hidden", |b: &Build| {
        let l = Linear::new(b, "hidden", 2, HIDDEN, true)?;
        Ok(Box::new(Dense(l, Tensor::tanh, "hidden")) as Box<dyn Layer>)
    }))
    .cut();
    m.push(LayerSpec::new("out", |b: &Build| {
        let l = Linear::new(b, "out", HIDDEN, 1, true)?;
        Ok(Box::new(Dense(l, sigmoid, "out")) as Box<dyn Layer>)
    }));
    m
}

/// Binary cross-entropy of probabilities against 0/1 targets `y` (PyTorch's `BCELoss`, its
/// log clamped at -100 as PyTorch clamps it), mean over rows.
pub struct Bce;

impl Loss for Bce {
    fn targets(&self) -> Vec<String> {
        vec!["y".into()]
    }

    fn count(&self, batch: &Batch) -> Result<usize> {
        Ok(batch.require("y", "the BCE loss")?.dim(0)?)
    }

    fn sum(&self, out: &Activation, batch: &Batch, _: &Cx, _: &Group) -> Result<(Tensor, usize)> {
        let p = out
            .tensors()
            .into_iter()
            .next()
            .ok_or_else(|| invalid!("the BCE loss takes one output"))?;
        let y = batch.require("y", "the BCE loss")?.to_dtype(p.dtype())?;
        let log = |t: &Tensor| -> Result<Tensor> { Ok(t.log()?.maximum(-100.0)?) };
        let one_minus = |t: &Tensor| -> Result<Tensor> { Ok(t.affine(-1.0, 1.0)?) };
        let terms = ((&y * log(p)?)? + (one_minus(&y)? * log(&one_minus(p)?)?)?)?;
        Ok((terms.sum_all()?.neg()?, y.dim(0)?))
    }
}

/// The experiment's body, run by every rank.
pub fn body(cx: &mut Context) -> Result<()> {
    let seed = cx.params().int("random_seed")? as u64;
    let (batch, epochs) = (
        cx.params().positive("batch_size")?,
        cx.params().positive("epochs")?,
    );
    let (pp, chunks) = (cx.params().positive("pp")?, cx.params().positive("chunks")?);
    let world = cx.get_num_processes();
    if !world.is_multiple_of(pp) || !batch.is_multiple_of(chunks) {
        return Err(invalid!(
            "{world} ranks do not split into --pp {pp} stages, or --batch-size {batch} into --chunks {chunks}"
        ));
    }
    let dp = world / pp;
    let samples = cx.params().positive("samples")?;
    let loader = |(replica, device)| {
        SmartDataLoader::new(
            Points::new(samples, seed),
            batch,
            true,
            seed,
            (replica, dp),
            device,
        )
    };
    // Every replica's share of the points makes as many batches.
    let per_epoch = loader((0, Device::Cpu))?.batches_per_epoch() as u64;
    let spec = TrainSpec {
        seed,
        // Epochs of the loader's batches, saved every `checkpoint_every` epochs.
        cadence: Cadence {
            checkpoint_every: cx.params().int("checkpoint_every")?.max(0) as u64 * per_epoch,
            ..Cadence::steps(epochs as u64 * per_epoch)
        },
        optim: OptimSpec {
            optimizer: OptimizerConfig::Sgd(SgdConfig {
                momentum: 0.9,
                ..Default::default()
            }),
            lr: LrSchedule::Constant {
                lr: cx.params().float("lr")?,
            },
            clip: None,
        },
        ..TrainSpec::new(Layout::new(pp, 1, dp)?, batch * dp, batch / chunks, 1)
    };
    // The front door, with the batches from this experiment's own loader (its hooks).
    let run = Run {
        loss: Arc::new(Bce),
        // --debug: the first NaN or inf fails the step, naming its layer and micro-batch.
        detect_anomaly: cx.params().flag("debug")?,
        ..Run::with_own_batches(spec, Arc::new(Custom::new("points", model())))
    };
    let trainer = Trainer::new(run, Some(world))?;
    // Builds this rank's part and restores the checkpoint the run goes on from; items
    // registered before or after it are restored either way.
    trainer.start(cx)?;
    let at = {
        let v = cx.engine()?;
        (v.coords().dp_rank, v.device().clone())
    };
    cx.register("loader", loader(at)?)?;
    if cx.is_master() {
        // Every step's loss under `train/loss` (tags.csv, TensorBoard); its count is restored
        // with the rest.
        let rec = Recorder::create(cx.dir(), "eval/held_out")?;
        cx.register("recorder", rec)?;
    }
    let mut hooks = PointsHooks {
        per_epoch,
        epoch: 0,
        losses: Vec::new(),
    };
    trainer.fit(cx, &mut hooks)?;
    let losses = hooks.losses;
    // The held-out loss: 64 points of another seed, every replica the same rows.
    let held = Points::new(64, seed + 1);
    let rows = (0..64).map(|i| held.get(i)).collect::<Result<Vec<_>>>()?;
    let cat = |name: &str| -> Result<Tensor> {
        let parts = rows
            .iter()
            .map(|r| r.require(name, "held-out").cloned())
            .collect::<Result<Vec<_>>>()?;
        Ok(Tensor::cat(&parts, 0)?.to_dtype(DType::F32)?)
    };
    let held = Batch::new().with("x", cat("x")?).with("y", cat("y")?);
    let eval = cx.engine()?.evaluate(&held, false)?;
    if cx.is_master() {
        cx.get::<Recorder>("recorder")?.flush()?;
        write_results(cx, &losses, eval.loss)?;
        if let Some((_, _, last)) = losses.last() {
            println!(
                "trained {} steps, last loss {last:.4}, held-out loss {:.4}",
                losses.len(),
                eval.loss
            );
        }
    }
    Ok(())
}

/// What this experiment does around the steps of the one loop: batches from the registered
/// loader (the next epoch where one ends), every step's loss in the recorder and in
/// `losses.csv`, and a line for each saved checkpoint.
struct PointsHooks {
    per_epoch: u64,
    /// The epoch of the batch being trained on.
    epoch: u64,
    /// (step, epoch, loss) of every step of this run.
    losses: Vec<(u64, u64, f64)>,
}

impl Hooks for PointsHooks {
    fn batch(&mut self, cx: &mut Context, _: u64) -> Result<Batch> {
        let l = cx.get::<SmartDataLoader<Points>>("loader")?;
        // At the end of an epoch the loader moves to the next one and gives nothing once.
        let indices = match l.next_indices() {
            Some(i) => i,
            None => l
                .next_indices()
                .ok_or_else(|| invalid!("this replica's share of the points is empty"))?,
        };
        self.epoch = l.epoch();
        l.collate(&indices)
    }

    fn after_step(&mut self, cx: &mut Context, d: &StepDone) -> Result<()> {
        let out = d.outcome;
        self.losses.push((out.step, self.epoch, out.loss));
        if cx.is_master() {
            let rec = cx.get::<Recorder>("recorder")?;
            rec.scalar("train/loss", out.loss)?;
            rec.step();
        }
        Ok(())
    }

    fn checkpoint(&mut self, cx: &mut Context, steps: u64, _: bool) -> Result<()> {
        let path = cx.checkpoint()?;
        if cx.is_master() {
            println!("epoch {}: saved {}", steps / self.per_epoch, path.display());
        }
        Ok(())
    }
}

/// `losses.csv` and `result.json` in the run directory.
fn write_results(cx: &Context, losses: &[(u64, u64, f64)], held_out: f64) -> Result<()> {
    let mut csv = String::from("step,epoch,loss\n");
    for (s, e, l) in losses {
        csv.push_str(&format!("{s},{e},{l}\n"));
    }
    let write = |name: &str, text: String| {
        let path = cx.dir().join(name);
        std::fs::write(&path, text).map_err(|e| Error::io("cannot write", &path, e))
    };
    write("losses.csv", csv)?;
    let result = serde_json::json!({
        "losses": losses.iter().map(|l| l.2).collect::<Vec<_>>(),
        "held_out_loss": held_out,
    });
    write("result.json", result.to_string())
}

/// The experiment with its parameters.
pub fn experiment() -> Experiment<fn(&mut Context) -> Result<()>> {
    Experiment::new("points", body as fn(&mut Context) -> Result<()>)
        .about("pystematic's example: a 2-D point classifier, BCE and SGD")
        .param(Param::float("lr", 0.5, "SGD learning rate (momentum 0.9)."))
        .param(Param::int(
            "batch_size",
            16,
            "Rows of a batch on each data-parallel replica.",
        ))
        .param(Param::int("epochs", 4, "Passes over the data."))
        .param(Param::int("samples", 256, "Points in the training set."))
        .param(Param::int(
            "pp",
            1,
            "Pipeline stages (the ranks divide into pp x dp).",
        ))
        .param(Param::int("chunks", 1, "Micro-batches of every batch."))
        .param(Param::int(
            "checkpoint_every",
            0,
            "Save the context every N epochs (0: never).",
        ))
}

#[allow(dead_code)]
fn main() {
    experiment().main();
}
