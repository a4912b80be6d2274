//! What a run writes and prints: `params.json`, the scalars, the progress bar, and the
//! one-screen summary (`summary.json`).

use std::time::Instant;

use indicatif::{ProgressBar, ProgressStyle};
use pipewright::engine::checkpoint::CheckpointOptions;
use pipewright::experiment::{peak_memory_bytes, Context, Recorder, RunDir, Summary};
use pipewright::plan::StepParts;
use pipewright::runtime::memory;
use pipewright::trainer::{Hooks, Recorded, StepDone};
use pipewright::{Batch, Result};
use pipewright_models::{RunSpec, TaskShape};
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
    /// The run as the library describes it (what checkpoints record too).
    spec: &'a RunSpec,
}

/// What `pipewright train` does around [`fit`]'s steps: the task's batches and metric, the
/// progress bar and log lines (on the reporting rank), the process's peak memory before the
/// first evaluation, and checkpoints that store what rebuilds the run. The record is the
/// library's ([`Recorded`]).
struct TrainHooks<'a> {
    run: &'a Setup,
    batch: &'a dyn Fn(u64) -> Result<Batch>,
    pb: ProgressBar,
    reporting: bool,
    first: u64,
    start: Instant,
    items_per_step: usize,
    items: &'static str,
    training_peak: Option<u64>,
    allocated_peak: Option<u64>,
    rank_allocated_peaks: Vec<u64>,
    /// The last evaluation's parts of the metric (a blend's datasets'), for the record.
    metric_parts: Vec<(String, f64)>,
}

impl Hooks for TrainHooks<'_> {
    fn batch(&mut self, _: &mut Context, step: u64) -> Result<Batch> {
        (self.batch)(step)
    }

    fn evaluate(&mut self, cx: &mut Context, _: u64) -> Result<Option<f64>> {
        let a = &self.run.a;
        if self.training_peak.is_none() {
            self.training_peak = peak_memory_bytes();
            // On a GPU the counting allocator sees the host's bytes, not the tensors: rank
            // 0's GPU's memory pool counts those (of every rank of this process on it).
            let counted = pipewright::runtime::device::in_host_memory(&a.parallel.device);
            self.allocated_peak = if counted {
                memory::peak_bytes()
            } else {
                pipewright::runtime::device::gpu_peak_bytes(&pipewright::runtime::device::device(
                    &a.parallel.device,
                    0,
                )?)?
            };
            if counted && !pipewright::distributed::Env::under_mpi() {
                self.rank_allocated_peaks =
                    (0..a.world()).filter_map(memory::rank_peak_bytes).collect();
            }
        }
        let trainer = cx.engine()?;
        let (metric, parts) = self
            .run
            .task
            .evaluate_parts(&mut |x| trainer.predict(&Batch::input(x.clone())))?;
        self.metric_parts = parts;
        Ok(Some(metric))
    }

    fn metric_parts(&mut self) -> Vec<(String, f64)> {
        std::mem::take(&mut self.metric_parts)
    }

    fn after_step(&mut self, _: &mut Context, d: &StepDone) -> Result<()> {
        // One numbering everywhere: a step is counted by the steps done with it (1 is the
        // first), in the console, scalars.csv, tags.csv, images and checkpoints alike.
        let loss = d.outcome.loss;
        let scaled = self.run.a.precision == pipewright::model::precision::Precision::F16;
        // An f16 run's dynamic loss scale and the steps it skipped on overflow, in the log
        // lines as on the progress bar (which a file or a CI log does not show).
        let scale = |sep: &str| {
            let (s, k) = (d.outcome.loss_scale, d.skipped);
            if scaled {
                format!("{sep}loss scale {s}{sep}skipped {k}")
            } else {
                String::new()
            }
        };
        if let (Some(m), true) = (d.metric, self.reporting) {
            let name = self.run.task.metric_name();
            let line = format!(
                "step {:>6}  loss {loss:.4}  {name} {m:.4}{}",
                d.steps,
                scale("  ")
            );
            self.pb.suspend(|| pipewright::say!("{line}"));
        }
        let done = d.steps - self.first;
        let rate = done as f64 * self.items_per_step as f64 / self.start.elapsed().as_secs_f64();
        let items = self.items;
        self.pb.set_message(format!(
            "loss {loss:.4} | {rate:.0} {items}/s{}",
            scale(" | ")
        ));
        self.pb.inc(1);
        Ok(())
    }

    fn checkpoint(&mut self, cx: &mut Context, steps: u64, background: bool) -> Result<()> {
        let opts = CheckpointOptions {
            keep: self.run.a.checkpoint.keep,
            meta: self.run.meta.clone(),
            extra: serde_json::json!({ "next_step": steps }),
        };
        cx.save(opts, background)
    }
}

/// The training of one rank over the trainer of `cx` (every rank runs it; only the one given
/// `dir` reports), through the library's [`fit`]. Returns the summary on the rank given `dir`.
pub fn train_loop(
    run: &Setup,
    num_params: usize,
    cx: &mut Context,
    first: u64,
    batch: &dyn Fn(u64) -> Result<Batch>,
    dir: Option<&RunDir>,
) -> Result<Option<Summary>> {
    let (a, task) = (&run.a, run.task.as_ref());
    let rec = match dir {
        Some(dir) => {
            dir.write_json(
                "params.json",
                &Params {
                    pipewright_version: env!("CARGO_PKG_VERSION"),
                    args: a,
                    task_shape: format!("{:?}", task.shape()),
                    num_params,
                    layers: run
                        .trainer
                        .model()
                        .specs()
                        .iter()
                        .map(|s| s.name().to_string())
                        .collect(),
                    cut_points: run.trainer.model().cut_points().to_vec(),
                    tied: run.trainer.tied().to_vec(),
                    spec: &run.spec,
                },
            )?;
            let tag = format!("eval/{}", task.metric_name());
            let mut rec = if run.continuing {
                // Rows of the steps after `first` go: they are recorded again.
                Recorder::resume(dir.path(), &tag, first + 1)?
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
        TaskShape::Tokens { seq_len, .. } => (a.batch.batch_size * seq_len, "tokens"),
        TaskShape::Images { .. } => (a.batch.batch_size, "samples"),
    };
    let layout = run
        .spec
        .train
        .describe_parallelism(a.schedule_file.as_deref());
    if let Some(dir) = dir {
        pipewright::say!(
            "pipewright train: {:?} ({num_params} parameters) on {} for {} steps, batch {} in micro-batches of {}{layout} -> {}",
            a.model,
            task.name(),
            a.cadence.steps,
            a.batch.batch_size,
            run.spec.train.batch.micro_batch,
            dir.path().display()
        );
    }
    let pb = if dir.is_some() {
        ProgressBar::new(a.cadence.steps)
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
    let mut hooks = TrainHooks {
        run,
        batch,
        pb,
        reporting: dir.is_some(),
        first,
        start: Instant::now(),
        items_per_step,
        items,
        training_peak: None,
        allocated_peak: None,
        rank_allocated_peaks: Vec::new(),
        metric_parts: Vec::new(),
    };
    let scaled = run.spec.train.precision.scales_loss();
    let mut recorded = Recorded::new(&mut hooks, rec, items_per_step, scaled);
    let report = run.trainer.fit(cx, &mut recorded)?;
    let rec = recorded.finish()?;
    hooks.pb.finish_and_clear();
    if report.stopped && dir.is_some() {
        pipewright::say!("preempted: saved step {} and stopping", report.steps);
    }
    if dir.is_none() || rec.is_none() {
        return Ok(None);
    }
    Ok(Some(Summary {
        steps: report.steps,
        final_loss: report.last_loss,
        metric_name: task.metric_name(),
        metric: report.metric,
        seconds: report.seconds,
        median_step_seconds: report.median_step_seconds(),
        items_per_second: (report.steps - report.first) as f64 * items_per_step as f64
            / report.step_seconds.iter().sum::<f64>(),
        items,
        peak_memory_bytes: peak_memory_bytes(),
        training_peak_memory_bytes: hooks.training_peak,
        training_peak_allocated_bytes: hooks.allocated_peak,
        rank_training_peak_allocated_bytes: hooks.rank_allocated_peaks,
        ..Summary::default()
    }))
}

/// Writes `summary.json` and prints the one-screen summary ([`Summary`]'s): the result, rank
/// 0's step part by part, the layout, which rank holds what, each stage's measured bubble and
/// each rank's exposed communication.
pub fn write_summary(
    run: &Setup,
    dir: &RunDir,
    mut summary: Summary,
    ranks: &[String],
    (bubbles, exposed): (&[f64], &[f64]),
    balance: &[usize],
    parts: StepParts,
) -> Result<()> {
    summary.median_step_parts = parts;
    summary.layout = format!("{} {}", run.spec.train.parallel.layout, run.a.precision);
    summary.balance = balance.to_vec();
    summary.ranks = ranks.to_vec();
    summary.bubble_per_stage = bubbles.to_vec();
    summary.exposed_comm_per_rank = exposed.to_vec();
    summary.device = run.a.parallel.device.clone();
    dir.write_json("summary.json", &summary)?;
    pipewright::say!("──────── summary ────────");
    pipewright::say!("run directory   {}", dir.path().display());
    pipewright::say!("{}", summary.to_string().trim_end());
    Ok(())
}
