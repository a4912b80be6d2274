//! A GPT experiment through the front door (`pipewright::trainer`): the adder task (2-digit sums) learned by a small GPT
//! over any pp x tp x dp layout of the run's ranks, written as a pipewright experiment. The
//! context holds the trainer, the step counter and (on the master) the recorder, so that
//! `--checkpoint` goes on where a run stopped; the recorder writes the loss and the held-out
//! accuracy by tag, the flags as hyperparameters, and the loss curve as a figure.
//!
//! ```sh
//! cargo run --release -p pipewright-models --example gpt_experiment -- --steps 300
//! cargo run --release -p pipewright-models --example gpt_experiment -- --distributed --nproc-per-node 4 --pp 2 --tp 2 --chunks 4
//! ```

use std::sync::Arc;

use pipewright::distributed::topology::Layout;
use pipewright::experiment::{Context, Experiment, LinePlot, Param, Recorder};
use pipewright::model::nn::optim::{AdamWConfig, LrSchedule, OptimizerConfig};
use pipewright::trainer::{Cadence, Hooks, Losses, Run, StepDone, TrainSpec, Trainer};
use pipewright::{invalid, Batch, Result};
use pipewright_models::tasks::Adder;
use pipewright_models::{GptConfig, Task, TaskShape};

/// The body every rank runs.
pub fn body(cx: &mut Context) -> Result<()> {
    let seed = cx.params().int("random_seed")? as u64;
    let (pp, tp) = (cx.params().positive("pp")?, cx.params().positive("tp")?);
    let (batch, chunks, steps) = (
        cx.params().positive("batch_size")?,
        cx.params().positive("chunks")?,
        cx.params().positive("steps")? as u64,
    );
    let world = cx.get_num_processes();
    if !world.is_multiple_of(pp * tp) {
        return Err(invalid!(
            "{world} ranks do not split into --pp {pp} x --tp {tp}"
        ));
    }
    let dp = world / (pp * tp);
    let task = Arc::new(Adder::new(2, seed)?);
    let TaskShape::Tokens { vocab, seq_len } = task.shape() else {
        return Err(invalid!("the adder task is made of tokens"));
    };
    let cfg = GptConfig {
        vocab_size: vocab.div_ceil(tp) * tp,
        block_size: seq_len,
        n_layer: cx.params().positive("n_layer")?,
        n_head: cx.params().positive("n_head")?,
        n_embd: cx.params().positive("n_embd")?,
        dropout: 0.0,
    };
    if !batch.is_multiple_of(dp * chunks) {
        return Err(invalid!(
            "--batch-size {batch} does not split into {dp} replicas x --chunks {chunks}"
        ));
    }
    let spec = TrainSpec {
        seed,
        cadence: Cadence {
            eval_every: cx.params().positive("eval_every")? as u64,
            checkpoint_every: cx.params().int("checkpoint_every")?.max(0) as u64,
            ..Cadence::steps(steps)
        },
        optim: pipewright::model::nn::optim::OptimSpec {
            optimizer: OptimizerConfig::AdamW(AdamWConfig::default()),
            lr: LrSchedule::Constant {
                lr: cx.params().float("lr")?,
            },
            ..Default::default()
        },
        ..TrainSpec::new(
            Layout::new(pp, tp, dp)?,
            batch,
            batch / (dp * chunks),
            steps,
        )
    };
    let data = {
        let task = task.clone();
        move |step: u64, rows: usize| -> Result<Batch> {
            let (x, y) = task.batch(step, rows)?;
            Ok(Batch::pair(x, y))
        }
    };
    // The front door: the GPT (tied weights, parallel rules) on the task's rows of each step.
    let run = Run {
        detect_anomaly: cx.params().flag("debug")?,
        ..Run::new(spec, Arc::new(cfg), Arc::new(data))
    };
    let trainer = Trainer::new(run, Some(world))?;
    if cx.is_master() {
        let mut rec = Recorder::create(cx.dir(), "eval/accuracy")?;
        rec.params(&cx.params().to_json())?;
        cx.register("recorder", rec)?;
    }
    let started = trainer.start(cx)?;
    let mut hooks = AdderHooks {
        task: &task,
        batches: Losses::new(started),
        curve: Vec::new(),
    };
    trainer.fit(cx, &mut hooks)?;
    Ok(())
}

/// What this experiment does around the steps of the one loop: the run's batches of the adder
/// task, its held-out accuracy, and (on the master) the recorder's loss, accuracy and loss
/// curve.
struct AdderHooks<'a> {
    task: &'a Adder,
    /// The rank's rows of each step, through the simplest hooks.
    batches: Losses,
    /// (step, loss): the loss curve drawn at every evaluation.
    curve: Vec<(f64, f64)>,
}

impl Hooks for AdderHooks<'_> {
    fn batch(&mut self, cx: &mut Context, step: u64) -> Result<Batch> {
        self.batches.batch(cx, step)
    }

    fn evaluate(&mut self, cx: &mut Context, _: u64) -> Result<Option<f64>> {
        let t = cx.engine()?;
        Ok(Some(
            self.task
                .evaluate(&mut |x| t.predict(&Batch::input(x.clone())))?,
        ))
    }

    fn after_step(&mut self, cx: &mut Context, d: &StepDone) -> Result<()> {
        self.curve.push((d.steps as f64, d.outcome.loss));
        if !cx.is_master() {
            return Ok(());
        }
        let rec = cx.get::<Recorder>("recorder")?;
        rec.set_count(d.steps);
        rec.scalar("train/loss", d.outcome.loss)?;
        if let Some(a) = d.metric {
            rec.scalar("eval/accuracy", a)?;
            rec.figure(
                "train/loss_curve",
                &LinePlot::loss_curve(self.curve.clone()),
            )?;
            println!(
                "step {:>5}  loss {:.4}  accuracy {a:.4}",
                d.steps, d.outcome.loss
            );
        }
        rec.flush()
    }
}

/// The experiment with its parameters.
pub fn experiment() -> Experiment<fn(&mut Context) -> Result<()>> {
    Experiment::new("gpt-adder", body as fn(&mut Context) -> Result<()>)
        .about("A GPT learns 2-digit addition on the Varuna step, over any pp x tp x dp layout")
        .param(Param::int("steps", 300, "Training steps."))
        .param(Param::int(
            "batch_size",
            64,
            "Rows of every step over all replicas.",
        ))
        .param(Param::int("chunks", 1, "Micro-batches per replica."))
        .param(Param::int("pp", 1, "Pipeline stages."))
        .param(Param::int(
            "tp",
            1,
            "Tensor-parallel ranks per stage (the rest is dp).",
        ))
        .param(Param::int("n_layer", 2, "GPT blocks."))
        .param(Param::int("n_head", 4, "Attention heads."))
        .param(Param::int("n_embd", 128, "Hidden size."))
        .param(Param::float("lr", 1e-3, "AdamW learning rate."))
        .param(Param::int(
            "eval_every",
            100,
            "Evaluate (and draw the loss curve) every N steps.",
        ))
        .param(Param::int(
            "checkpoint_every",
            0,
            "Save the context every N steps (0: never).",
        ))
}

#[allow(dead_code)]
fn main() {
    experiment().main();
}
