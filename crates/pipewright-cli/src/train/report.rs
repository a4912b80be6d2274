//! What a run writes and prints: `params.json`, the scalars, the progress bar, and the
//! one-screen summary (`summary.json`).

use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use pipewright::checkpoint::CheckpointOptions;
use pipewright::experiment::recorder::ScalarRow;
use pipewright::experiment::{peak_memory_bytes, Context, LinePlot, Recorder, RunDir};
use pipewright::memory;
use pipewright::nn::optim::LrSchedule;
use pipewright::{Batch, Result};
use pipewright_models::TaskShape;
use serde::Serialize;

use super::{Setup, TrainArgs};

/// `params.json`: every flag and what they made.
#[derive(Serialize)]
pub struct Params<'a> {
    pipewright_version: &'static str,
    #[serde(flatten)]
    args: &'a TrainArgs,
    task_shape: String,
    num_params: usize,
    layers: Vec<String>,
    cut_points: Vec<usize>,
    tied: Vec<(String, String)>,
    lr_schedule: LrSchedule,
}

/// `summary.json`: the result, the layout and where the time went.
#[derive(Serialize)]
pub struct Summary {
    steps: u64,
    final_loss: f64,
    metric_name: &'static str,
    metric: f64,
    seconds: f64,
    /// The median of the steps' own times (evaluation and checkpoints left out).
    median_step_seconds: f64,
    items_per_second: f64,
    items: &'static str,
    peak_memory_bytes: Option<u64>,
    /// The process's peak before its first evaluation: training's own (the task's greedy
    /// decoding can hold more).
    training_peak_memory_bytes: Option<u64>,
    /// The most bytes held at once before the first evaluation as the allocator counts them
    /// ([`pipewright::memory`]: without what glibc keeps back after a free) ...
    training_peak_allocated_bytes: Option<u64>,
    /// ... and each rank's, for ranks running as threads of this process (empty under
    /// mpirun, where each process is one rank and the line above is its own).
    rank_training_peak_allocated_bytes: Vec<u64>,
    layout: String,
    ranks: Vec<String>,
    bubble_per_stage: Vec<f64>,
    /// Layers per model stage.
    balance: Vec<usize>,
}

/// The training loop of one rank over the trainer of `cx` (every rank runs it; only the one
/// given `dir` reports). Returns the summary on the rank given `dir`.
pub fn train_loop(
    run: &Setup,
    num_params: usize,
    cx: &mut Context,
    first: u64,
    batch: &dyn Fn(u64) -> Result<Batch>,
    dir: Option<&RunDir>,
) -> Result<Option<Summary>> {
    let (a, task) = (&run.a, run.task.as_ref());
    let mut rec = match dir {
        Some(dir) => {
            dir.write_json(
                "params.json",
                &Params {
                    pipewright_version: env!("CARGO_PKG_VERSION"),
                    args: a,
                    task_shape: format!("{:?}", task.shape()),
                    num_params,
                    layers: run
                        .model
                        .specs()
                        .iter()
                        .map(|s| s.name().to_string())
                        .collect(),
                    cut_points: run.model.cut_points().to_vec(),
                    tied: run.tied.clone(),
                    lr_schedule: run.sched,
                },
            )?;
            let tag = format!("eval/{}", task.metric_name());
            let mut rec = if run.continuing {
                Recorder::resume(dir.path(), &tag, first)?
            } else {
                Recorder::create(dir.path(), &tag)?
            };
            // The flags as TensorBoard hyperparameters.
            let flags = serde_json::to_value(a).map_err(|e| pipewright::invalid!("{e}"))?;
            rec.params(&flags)?;
            Some(rec)
        }
        None => None,
    };
    let (items_per_step, items) = match task.shape() {
        TaskShape::Tokens { seq_len, .. } => (a.batch_size * seq_len, "tokens"),
        TaskShape::Images { .. } => (a.batch_size, "samples"),
    };
    let mut layout = String::new();
    if a.pp > 1 {
        layout += &format!(
            ", pipeline pp={} {} virtual={}",
            a.pp, a.schedule, a.virtual_stages
        );
    }
    if a.tp > 1 {
        layout += &format!(", tensor-parallel tp={}", a.tp);
    }
    if let Some(dir) = dir {
        println!(
            "pipewright train: {:?} ({num_params} parameters) on {} for {} steps, batch {} in micro-batches of {}{layout} -> {}",
            a.model,
            task.name(),
            a.steps,
            a.batch_size,
            run.chunk_size,
            dir.path().display()
        );
    }
    let pb = if dir.is_some() {
        ProgressBar::new(a.steps)
    } else {
        ProgressBar::hidden()
    };
    pb.set_position(first);
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:30} step {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
        )
        .expect("valid template"),
    );
    let start = Instant::now();
    let mut last_loss = f64::NAN;
    let mut metric = f64::NAN;
    let mut done_steps = first;
    let mut step_times = Vec::new();
    // (step, loss) of this run's steps: the loss curve drawn at every evaluation.
    let mut curve = Vec::new();
    let mut training_peak = None;
    let (mut allocated_peak, mut rank_allocated_peaks) = (None, Vec::new());
    for step in first..a.steps {
        let b = batch(step)?;
        let trainer = cx.trainer()?;
        let t = Instant::now();
        let r = trainer.step(&b)?;
        step_times.push(t.elapsed().as_secs_f64());
        last_loss = r.loss;
        let last = step + 1 == a.steps;
        let eval_now = (step + 1) % a.eval_every == 0 || last;
        if eval_now && training_peak.is_none() {
            training_peak = peak_memory_bytes();
            allocated_peak = memory::peak_bytes();
            if !pipewright::dist::Env::under_mpi() {
                rank_allocated_peaks = (0..a.pp * a.tp * a.dp)
                    .filter_map(memory::rank_peak_bytes)
                    .collect();
            }
        }
        let m = if eval_now {
            metric = task.evaluate(&mut |x| trainer.predict(&Batch::input(x.clone())))?;
            let line = format!(
                "step {:>6}  loss {:.4}  {} {:.4}",
                step + 1,
                r.loss,
                task.metric_name(),
                metric
            );
            if dir.is_some() {
                pb.suspend(|| println!("{line}"));
            }
            Some(metric)
        } else {
            None
        };
        curve.push(((step + 1) as f64, r.loss));
        if let Some(rec) = rec.as_mut().filter(|_| eval_now) {
            rec.set_count(step + 1);
            rec.figure("train/loss_curve", &LinePlot::new(curve.clone()))?;
        }
        if let Some(rec) = rec.as_mut().filter(|_| step % a.log_every == 0 || eval_now) {
            rec.record(ScalarRow {
                step,
                loss: r.loss,
                lr: r.lr,
                metric: m,
            })?;
        }
        let saving = a.checkpoint_every > 0 && (step + 1) % a.checkpoint_every == 0;
        // A preemption notice on any rank (SIGTERM, or SIGUSR1 from `pipewright launch`):
        // every rank finishes this step, saves it and ends the run.
        let stop = trainer.any_rank(run.stop.load(std::sync::atomic::Ordering::Relaxed))?;
        if saving || stop {
            if let Some(rec) = rec.as_mut() {
                rec.flush()?;
            }
            save(run, cx, step + 1, a.async_checkpoint && !stop)?;
        }
        pipewright::dist::heartbeat(step + 1)?;
        done_steps = step + 1;
        if stop {
            if dir.is_some() {
                pb.suspend(|| println!("preempted: saved step {} and stopping", step + 1));
            }
            break;
        }
        let done = step + 1 - first;
        let rate = done as f64 * items_per_step as f64 / start.elapsed().as_secs_f64();
        pb.set_message(format!("loss {:.4} | {:.0} {items}/s", r.loss, rate));
        pb.inc(1);
    }
    pb.finish_and_clear();
    cx.trainer()?.finish_checkpoint()?;
    let (Some(_), Some(rec)) = (dir, rec.as_mut()) else {
        return Ok(None);
    };
    rec.flush()?;
    let secs = start.elapsed().as_secs_f64();
    Ok(Some(Summary {
        steps: done_steps,
        final_loss: last_loss,
        metric_name: task.metric_name(),
        metric,
        seconds: secs,
        median_step_seconds: crate::bench::median(step_times),
        items_per_second: done_steps.saturating_sub(first) as f64 * items_per_step as f64 / secs,
        items,
        peak_memory_bytes: peak_memory_bytes(),
        training_peak_memory_bytes: training_peak,
        training_peak_allocated_bytes: allocated_peak,
        rank_training_peak_allocated_bytes: rank_allocated_peaks,
        layout: String::new(),
        ranks: Vec::new(),
        bubble_per_stage: Vec::new(),
        balance: Vec::new(),
    }))
}

/// Writes `summary.json` and prints the one-screen summary: the result, the layout, which
/// rank holds what, and each stage's measured bubble.
pub fn write_summary(
    a: &TrainArgs,
    dir: &RunDir,
    mut summary: Summary,
    ranks: &[String],
    bubbles: &[f64],
    balance: &[usize],
) -> Result<()> {
    summary.layout = format!("pp={} tp={} dp={} {}", a.pp, a.tp, a.dp, a.precision);
    summary.balance = balance.to_vec();
    summary.ranks = ranks.to_vec();
    summary.bubble_per_stage = bubbles.to_vec();
    dir.write_json("summary.json", &summary)?;
    println!("──────── summary ────────");
    println!("run directory   {}", dir.path().display());
    println!("steps           {}", summary.steps);
    println!("final loss      {:.6}", summary.final_loss);
    println!("{:<15} {:.4}", summary.metric_name, summary.metric);
    println!("time            {:.1} s", summary.seconds);
    println!(
        "step time       {:.1} ms (median)",
        summary.median_step_seconds * 1e3
    );
    println!(
        "throughput      {:.0} {}/s",
        summary.items_per_second, summary.items
    );
    if let Some(p) = summary.peak_memory_bytes {
        println!("peak memory     {:.1} MiB", p as f64 / (1024.0 * 1024.0));
    }
    if let Some(p) = summary.training_peak_memory_bytes {
        println!(
            "training peak   {:.1} MiB (before the first evaluation)",
            p as f64 / (1024.0 * 1024.0)
        );
    }
    if let Some(p) = summary.training_peak_allocated_bytes {
        let ranks = &summary.rank_training_peak_allocated_bytes;
        let most = ranks.iter().max().map_or(String::new(), |r| {
            format!(
                ", the most of one rank {:.1} MiB",
                *r as f64 / (1024.0 * 1024.0)
            )
        });
        println!(
            "allocated peak  {:.1} MiB{most} (live bytes, before the first evaluation)",
            p as f64 / (1024.0 * 1024.0)
        );
    }
    println!("layout          {}", summary.layout);
    let b: Vec<String> = balance.iter().map(|n| n.to_string()).collect();
    println!("balance         {} (layers per model stage)", b.join(","));
    if ranks.len() > 1 {
        for r in ranks {
            println!("  {r}");
        }
        let b: Vec<String> = bubbles
            .iter()
            .enumerate()
            .map(|(s, b)| format!("stage {s} {:.0}%", b * 100.0))
            .collect();
        println!("bubble          {} (time each stage waited)", b.join(", "));
    }
    Ok(())
}

/// A checkpoint of the context after `next` steps into the run's checkpoint directory (in the
/// background when `background`); it stores what `ckpt reshard` and `ckpt export` need to
/// rebuild the run.
fn save(run: &Setup, cx: &mut Context, next: u64, background: bool) -> Result<()> {
    let opts = CheckpointOptions {
        keep: run.a.keep,
        meta: run.meta.clone(),
        extra: serde_json::json!({ "next_step": next }),
    };
    cx.save(opts, background)
}
