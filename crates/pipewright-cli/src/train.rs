//! `pipewright train`: a reference model on a task, on one device or split over pipeline (pp)
//! and tensor-parallel (tp) ranks: threads of this process, or processes under mpirun.

use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use pipewright::candle_core::Tensor;
use pipewright::comm::{local, Communicator};
use pipewright::data_parallel::DistributedLoader;
use pipewright::experiment::recorder::ScalarRow;
use pipewright::experiment::{peak_memory_bytes, Recorder, RunDir};
use pipewright::nn::optim::{AdamW, AdamWConfig, LrSchedule, Optimizer, Sgd, SgdConfig};
use pipewright::pipeline::executor::{chrome_trace, Recompute, TraceEvent};
use pipewright::pipeline::partition::partition;
use pipewright::pipeline::schedule::{Kind, Schedule};
use pipewright::precision::Precision;
use pipewright::serial::Trainer;
use pipewright::topology::Layout;
use pipewright::varuna::{Varuna, VarunaOptions};
use pipewright::{invalid, Error, Result, Sequential};
use pipewright_models::tasks::{Adder, Shapes, Sort, Text};
use pipewright_models::{cnn, gpt, CnnConfig, GptConfig, Task, TaskShape, TIED};
use serde::Serialize;

#[derive(Clone, Copy, Debug, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    Gpt,
    Cnn,
}

#[derive(Clone, Copy, Debug, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskKind {
    Adder,
    Sort,
    Text,
    Shapes,
}

#[derive(Clone, Copy, Debug, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OptimizerKind {
    Adamw,
    Sgd,
}

#[derive(Clone, Copy, Debug, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ScheduleKind {
    Constant,
    Cosine,
}

/// Every flag of a run; written to `params.json`.
#[derive(Args, Debug, Serialize)]
pub struct TrainArgs {
    #[arg(long, value_enum, default_value = "gpt")]
    pub model: ModelKind,
    #[arg(long, value_enum, default_value = "adder")]
    pub task: TaskKind,
    /// Text file for `--task text`.
    #[arg(long)]
    pub data: Option<PathBuf>,
    #[arg(long, default_value_t = 1000, value_parser = positive_u64)]
    pub steps: u64,
    /// Rows of every step, over all data-parallel replicas.
    #[arg(long, default_value_t = 64, value_parser = positive)]
    pub batch_size: usize,
    /// Micro-batches per batch, over all replicas (gradient accumulation; the same mathematics
    /// as one batch): each of the --dp replicas takes --chunks / --dp of them.
    #[arg(long, default_value_t = 1, value_parser = positive)]
    pub chunks: usize,
    /// How ranks talk: threads of this process (local), or one process per rank under
    /// `mpirun -np P` (mpi; build with `--features mpi`).
    #[arg(long, value_enum, default_value = "local")]
    pub backend: crate::bench::Backend,
    /// Pipeline stages (ranks as threads of this process).
    #[arg(long, default_value_t = 1, value_parser = positive)]
    pub pp: usize,
    /// Tensor-parallel ranks per stage (Megatron's split of the GPT: heads, MLP, vocabulary).
    #[arg(long, default_value_t = 1, value_parser = positive)]
    pub tp: usize,
    /// Data-parallel replicas (each takes its rows of every batch; gradients are summed).
    #[arg(long, default_value_t = 1, value_parser = positive)]
    pub dp: usize,
    /// What the model computes in: f32, bf16, or f16 (with dynamic loss scaling); the
    /// optimizer keeps f32 master weights.
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// Pipeline schedule: gpipe, 1f1b, interleaved or zb1 (zero-bubble H1).
    #[arg(long, default_value = "1f1b")]
    pub schedule: String,
    /// Model chunks per pipeline stage (interleaved schedule).
    #[arg(long = "virtual", default_value_t = 1, value_parser = positive)]
    pub virtual_stages: usize,
    /// Activation recomputation: always, except_last or never.
    #[arg(long, default_value = "never")]
    pub recompute: String,
    /// Deferred batch norm: BatchNorm running statistics move once per batch, over all
    /// micro-batches (as whole-batch statistics would).
    #[arg(long)]
    pub deferred_batch_norm: bool,
    /// Write a Chrome trace of the pipeline's actions (open it in Perfetto).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Layers (or segments between cut points) per model stage, comma-separated.
    #[arg(long, value_delimiter = ',')]
    pub balance: Option<Vec<usize>>,
    /// Peak learning rate.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    /// Learning-rate schedule: constant, or linear warm-up then cosine decay.
    #[arg(long = "lr-schedule", value_enum, default_value = "cosine")]
    pub lr_decay: ScheduleKind,
    /// Warm-up steps of the cosine schedule.
    #[arg(long, default_value_t = 100)]
    pub warmup: u64,
    /// Final learning rate of the cosine schedule, as a fraction of --lr.
    #[arg(long, default_value_t = 0.1)]
    pub min_lr_ratio: f64,
    #[arg(long, value_enum, default_value = "adamw")]
    pub optimizer: OptimizerKind,
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f64,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Clip the global gradient norm to this value (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    pub clip: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Run directory (created; must not already hold a run).
    #[arg(long, default_value = "runs/latest")]
    pub out: PathBuf,
    /// Write one scalars row every K steps.
    #[arg(long, default_value_t = 1, value_parser = positive_u64)]
    pub log_every: u64,
    /// Evaluate the task's metric every K steps (and at the end).
    #[arg(long, default_value_t = 250, value_parser = positive_u64)]
    pub eval_every: u64,
    // GPT sizes.
    #[arg(long, default_value_t = 2, value_parser = positive)]
    pub n_layer: usize,
    #[arg(long, default_value_t = 4, value_parser = positive)]
    pub n_head: usize,
    #[arg(long, default_value_t = 128, value_parser = positive)]
    pub n_embd: usize,
    /// Longest sequence the GPT accepts (default: the task's sequence length).
    #[arg(long, value_parser = positive)]
    pub block_size: Option<usize>,
    #[arg(long, default_value_t = 0.0)]
    pub dropout: f64,
    /// GPT vocabulary (default: the task's); a larger one pads the vocabulary, for example to
    /// a multiple of --tp. Padded ids never occur.
    #[arg(long, value_parser = positive)]
    pub vocab_size: Option<usize>,
    // CNN sizes.
    /// CNN channels of the first blocks.
    #[arg(long, default_value_t = 16, value_parser = positive)]
    pub width: usize,
    /// CNN: a long skip connection from the stem to the head (crosses every pipeline stage).
    #[arg(long)]
    pub long_skip: bool,
    /// CNN residual blocks.
    #[arg(long, default_value_t = 4, value_parser = positive)]
    pub blocks: usize,
    // Task options.
    /// Digits of each adder operand.
    #[arg(long, default_value_t = 2, value_parser = positive)]
    pub digits: usize,
    /// Side of the shapes images.
    #[arg(long, default_value_t = 16, value_parser = positive)]
    pub image_size: usize,
}

/// Parses a size flag: a positive integer, with a message that says so.
fn positive_u64(s: &str) -> std::result::Result<u64, String> {
    let v: i128 = s
        .trim()
        .parse()
        .map_err(|_| format!("must be a positive integer, got `{s}`"))?;
    if v <= 0 {
        return Err(format!("must be a positive integer, got {v}"));
    }
    u64::try_from(v).map_err(|_| format!("{v} is too large"))
}

fn positive(s: &str) -> std::result::Result<usize, String> {
    positive_u64(s).and_then(|v| usize::try_from(v).map_err(|_| format!("{v} is too large")))
}

fn make_task(a: &TrainArgs) -> Result<Box<dyn Task>> {
    if a.data.is_some() && !matches!(a.task, TaskKind::Text) {
        return Err(invalid!("--data is only read by --task text"));
    }
    Ok(match a.task {
        TaskKind::Adder => Box::new(Adder::new(a.digits, a.seed)?),
        TaskKind::Sort => Box::new(Sort::new(6, 3, a.seed)?),
        TaskKind::Shapes => Box::new(Shapes::new(a.image_size, a.seed)?),
        TaskKind::Text => {
            let path = a
                .data
                .as_ref()
                .ok_or_else(|| invalid!("--task text needs --data FILE (any text file)"))?;
            Box::new(Text::from_file(path, a.block_size.unwrap_or(64), a.seed)?)
        }
    })
}

fn make_model(a: &TrainArgs, task: &dyn Task) -> Result<(Sequential, Vec<(String, String)>)> {
    match (a.model, task.shape()) {
        (ModelKind::Gpt, TaskShape::Tokens { vocab, seq_len }) => {
            let block_size = a.block_size.unwrap_or(seq_len);
            if block_size < seq_len {
                return Err(invalid!(
                    "--block-size {block_size} is shorter than the task's sequences of {seq_len} tokens"
                ));
            }
            let vocab_size = a.vocab_size.unwrap_or(vocab);
            if vocab_size < vocab {
                return Err(invalid!(
                    "--vocab-size {vocab_size} is smaller than the task's vocabulary of {vocab}"
                ));
            }
            if !vocab_size.is_multiple_of(a.tp) {
                let padded = vocab_size.div_ceil(a.tp) * a.tp;
                return Err(invalid!(
                    "a vocabulary of {vocab_size} cannot be split over --tp {}: pass --vocab-size {padded} \
                     (padded ids never occur)",
                    a.tp
                ));
            }
            if !a.n_head.is_multiple_of(a.tp) {
                return Err(invalid!(
                    "--n-head {} cannot be split over --tp {}: choose a multiple of --tp",
                    a.n_head,
                    a.tp
                ));
            }
            let cfg = GptConfig {
                vocab_size,
                block_size,
                n_layer: a.n_layer,
                n_head: a.n_head,
                n_embd: a.n_embd,
                dropout: a.dropout,
            };
            Ok((gpt(cfg)?, vec![(TIED.0.into(), TIED.1.into())]))
        }
        (
            ModelKind::Cnn,
            TaskShape::Images {
                channels, classes, ..
            },
        ) => {
            if a.tp > 1 {
                return Err(invalid!(
                    "--tp splits the GPT's layers; the CNN has no tensor-parallel layers: use --tp 1"
                ));
            }
            let cfg = CnnConfig {
                in_channels: channels,
                classes,
                width: a.width,
                blocks: a.blocks,
                blocks_per_stage: 2,
                long_skip: a.long_skip,
            };
            Ok((cnn(cfg)?, Vec::new()))
        }
        (ModelKind::Gpt, _) => Err(invalid!(
            "--model gpt needs a token task (adder, sort, text), not {}",
            task.name()
        )),
        (ModelKind::Cnn, _) => Err(invalid!(
            "--model cnn needs an image task (shapes), not {}",
            task.name()
        )),
    }
}

fn make_optimizer(
    a: &TrainArgs,
    params: Vec<(String, pipewright::candle_core::Var)>,
) -> Result<Box<dyn Optimizer>> {
    Ok(match a.optimizer {
        OptimizerKind::Adamw => Box::new(AdamW::new(
            params,
            AdamWConfig {
                weight_decay: a.weight_decay,
                ..Default::default()
            },
        )?),
        OptimizerKind::Sgd => Box::new(Sgd::new(
            params,
            SgdConfig {
                momentum: a.momentum,
                weight_decay: a.weight_decay,
                ..Default::default()
            },
        )?),
    })
}

fn schedule(a: &TrainArgs) -> LrSchedule {
    match a.lr_decay {
        ScheduleKind::Constant => LrSchedule::Constant { lr: a.lr },
        ScheduleKind::Cosine => LrSchedule::WarmupCosine {
            lr: a.lr,
            warmup: a.warmup.min(a.steps),
            total: a.steps,
            min_lr: a.lr * a.min_lr_ratio,
        },
    }
}

#[derive(Serialize)]
struct Params<'a> {
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

#[derive(Serialize)]
struct Summary {
    steps: u64,
    final_loss: f64,
    metric_name: &'static str,
    metric: f64,
    seconds: f64,
    items_per_second: f64,
    items: &'static str,
    peak_memory_bytes: Option<u64>,
    layout: String,
    ranks: Vec<String>,
    bubble_per_stage: Vec<f64>,
}

pub fn run(a: TrainArgs) -> Result<()> {
    // Ranks on this machine: the threads of this process, or MPI's processes on this node.
    let ranks_here = match a.backend {
        crate::bench::Backend::Local => a.pp * a.tp * a.dp,
        crate::bench::Backend::Mpi => std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1),
    };
    pipewright::comm::size_thread_pools(ranks_here);
    if a.clip < 0.0 || !a.clip.is_finite() {
        return Err(invalid!("--clip must be >= 0 (0 turns clipping off)"));
    }
    if !(0.0..=1.0).contains(&a.min_lr_ratio) {
        return Err(invalid!("--min-lr-ratio must lie in [0, 1]"));
    }
    let kind: Kind = a.schedule.parse()?;
    let recompute: Recompute = a.recompute.parse()?;
    let task = make_task(&a)?;
    let (model, tied) = make_model(&a, task.as_ref())?;
    let sched = schedule(&a);
    sched.validate()?;
    let precision: Precision = a.precision.parse()?;
    if !a.batch_size.is_multiple_of(a.chunks) {
        return Err(invalid!(
            "--batch-size {} is not divisible by --chunks {}: micro-batches must be equal",
            a.batch_size,
            a.chunks
        ));
    }
    if !a.chunks.is_multiple_of(a.dp) {
        return Err(invalid!(
            "--chunks {} is not a multiple of --dp {}: each replica takes --chunks / --dp of the \
             batch's micro-batches",
            a.chunks,
            a.dp
        ));
    }
    // Fail on a bad split or schedule before anything is written (each replica runs the
    // schedule over its --chunks / --dp micro-batches).
    partition(&model, a.pp * a.virtual_stages, a.balance.as_deref())?;
    Schedule::new(kind, a.pp, a.chunks / a.dp, a.virtual_stages)?;
    if a.trace.is_some() && a.pp == 1 {
        return Err(invalid!(
            "--trace records pipeline actions: use it with --pp 2 or more"
        ));
    }
    let clip = (a.clip > 0.0).then_some(a.clip);
    let setup = Setup {
        a: &a,
        task: task.as_ref(),
        model: &model,
        tied: &tied,
        sched,
        kind,
        recompute,
        clip,
        precision,
    };
    let traces = match a.backend {
        crate::bench::Backend::Mpi => return run_mpi(&setup),
        crate::bench::Backend::Local => {
            let dir = RunDir::create(&a.out)?;
            let world = a.pp * a.tp * a.dp;
            local::run(world, |comm| {
                let master = comm.is_master();
                setup.rank(Box::new(comm), master.then_some(&dir))
            })?
        }
    };
    let traces: Vec<Vec<TraceEvent>> = traces.into_iter().flatten().collect();
    write_trace(&a, &traces)
}

fn write_trace(a: &TrainArgs, traces: &[Vec<TraceEvent>]) -> Result<()> {
    if let Some(path) = &a.trace {
        std::fs::write(path, chrome_trace(traces))
            .map_err(|e| Error::io("cannot write trace", path, e))?;
        println!(
            "trace           {} (open in https://ui.perfetto.dev)",
            path.display()
        );
    }
    Ok(())
}

/// One process per rank under `mpirun -np P`: rank 0 writes the run directory. A rank that
/// fails ends the whole job (MPI would otherwise leave the others waiting).
#[cfg(feature = "mpi")]
fn run_mpi(setup: &Setup) -> Result<()> {
    use pipewright::comm::mpi::Mpi;
    let a = setup.a;
    let (_mpi, world) = Mpi::init()?;
    let rank = world.rank();
    let result = (|| {
        let n = a.pp * a.tp * a.dp;
        if world.size() != n {
            return Err(invalid!(
                "mpirun started {} ranks but --pp {} x --tp {} x --dp {} needs {n}: start it with mpirun -np {n}",
                world.size(),
                a.pp,
                a.tp,
                a.dp
            ));
        }
        let dir = if world.is_master() {
            Some(RunDir::create(&a.out)?)
        } else {
            None
        };
        let trace = setup.rank(Box::new(world), dir.as_ref())?;
        if rank == 0 {
            if a.trace.is_some() {
                eprintln!("note: under MPI the trace holds rank 0's actions only");
            }
            write_trace(a, &[trace.unwrap_or_default()])?;
        }
        Ok(())
    })();
    if let Err(e) = result {
        eprintln!("error: rank {rank}: {e}");
        Mpi::abort(1);
    }
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn run_mpi(_: &Setup) -> Result<()> {
    Err(invalid!(
        "this pipewright was built without MPI: build with `--features mpi` (tools/install-mpi.sh \
         installs Open MPI) and start it under `mpirun -np P`"
    ))
}

/// Everything a pipeline rank needs to build its part and train.
struct Setup<'a> {
    a: &'a TrainArgs,
    task: &'a dyn Task,
    model: &'a Sequential,
    tied: &'a [(String, String)],
    sched: LrSchedule,
    kind: Kind,
    recompute: Recompute,
    clip: Option<f64>,
    precision: Precision,
}

impl Setup<'_> {
    /// One rank of the world (`comm`): build its stages and shards, train on its replica's
    /// rows, return its trace if it is the first rank of its stage (the one traced).
    fn rank(
        &self,
        comm: Box<dyn Communicator>,
        dir: Option<&RunDir>,
    ) -> Result<Option<Vec<TraceEvent>>> {
        let a = self.a;
        let layout = Layout::new(a.pp, a.tp, a.dp)?;
        let opts = VarunaOptions {
            shared_weights: self.tied.to_vec(),
            precision: self.precision,
            seed: a.seed,
            schedule: self.kind,
            virtual_stages: a.virtual_stages,
            balance: a.balance.clone(),
            recompute: self.recompute,
            deferred_batch_norm: a.deferred_batch_norm,
            clip: self.clip,
            lr: self.sched,
            ..VarunaOptions::new(layout, a.batch_size, a.batch_size / a.chunks)
        };
        let mut v = Varuna::new(self.model, comm, opts)?;
        v.set_optimizer(|ps| make_optimizer(a, ps))?;
        let traced = a.trace.is_some() && v.coords().tp_rank == 0 && v.coords().dp_rank == 0;
        if traced {
            v.keep_trace();
        }
        let c = v.coords();
        let task = self.task;
        let loader = DistributedLoader::new(
            |step, rows| task.batch(step, rows),
            a.batch_size,
            c.dp_rank,
            a.dp,
            pipewright::candle_core::Device::Cpu,
        )?;
        let num_params = v.pipeline().total_params()?;
        let done = train_loop(self, num_params, &mut v, &|step| loader.batch(step), dir)?;
        let bubbles = v.bubble_per_stage()?;
        if let (Some(dir), Some(done)) = (dir, done) {
            write_summary(a, dir, done, &v.describe()?, &bubbles)?;
        }
        Ok(traced.then(|| v.take_trace()))
    }
}

/// The training loop of one rank (every rank runs it; only the one given `dir` reports).
/// Returns the summary on the rank given `dir`.
fn train_loop(
    run: &Setup,
    num_params: usize,
    trainer: &mut dyn Trainer,
    batch: &dyn Fn(u64) -> Result<(Tensor, Tensor)>,
    dir: Option<&RunDir>,
) -> Result<Option<Summary>> {
    let (a, task) = (run.a, run.task);
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
                    tied: run.tied.to_vec(),
                    lr_schedule: run.sched,
                },
            )?;
            Some(Recorder::create(
                dir.path(),
                &format!("eval/{}", task.metric_name()),
            )?)
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
            "pipewright train: {:?} ({num_params} parameters) on {} for {} steps, batch {} in {} chunks{layout} -> {}",
            a.model,
            task.name(),
            a.steps,
            a.batch_size,
            a.chunks,
            dir.path().display()
        );
    }
    let pb = if dir.is_some() {
        ProgressBar::new(a.steps)
    } else {
        ProgressBar::hidden()
    };
    pb.set_style(
        ProgressStyle::with_template(
            "{bar:30} step {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
        )
        .expect("valid template"),
    );
    let start = Instant::now();
    let mut last_loss = f64::NAN;
    let mut metric = f64::NAN;
    for step in 0..a.steps {
        let (x, y) = batch(step)?;
        let r = trainer.step(&x, &y)?;
        last_loss = r.loss;
        let last = step + 1 == a.steps;
        let eval_now = (step + 1) % a.eval_every == 0 || last;
        let m = if eval_now {
            metric = task.evaluate(&mut |x| trainer.predict(x))?;
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
        if let Some(rec) = rec.as_mut().filter(|_| step % a.log_every == 0 || eval_now) {
            rec.record(ScalarRow {
                step,
                loss: r.loss,
                lr: r.lr,
                metric: m,
            })?;
        }
        let rate = (step + 1) as f64 * items_per_step as f64 / start.elapsed().as_secs_f64();
        pb.set_message(format!("loss {:.4} | {:.0} {items}/s", r.loss, rate));
        pb.inc(1);
    }
    pb.finish_and_clear();
    let (Some(_), Some(rec)) = (dir, rec.as_mut()) else {
        return Ok(None);
    };
    rec.flush()?;
    let secs = start.elapsed().as_secs_f64();
    Ok(Some(Summary {
        steps: a.steps,
        final_loss: last_loss,
        metric_name: task.metric_name(),
        metric,
        seconds: secs,
        items_per_second: a.steps as f64 * items_per_step as f64 / secs,
        items,
        peak_memory_bytes: peak_memory_bytes(),
        layout: String::new(),
        ranks: Vec::new(),
        bubble_per_stage: Vec::new(),
    }))
}

/// Writes `summary.json` and prints the one-screen summary: the result, the layout, which
/// rank holds what, and each stage's measured bubble.
fn write_summary(
    a: &TrainArgs,
    dir: &RunDir,
    mut summary: Summary,
    ranks: &[String],
    bubbles: &[f64],
) -> Result<()> {
    summary.layout = format!("pp={} tp={} dp={} {}", a.pp, a.tp, a.dp, a.precision);
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
        "throughput      {:.0} {}/s",
        summary.items_per_second, summary.items
    );
    if let Some(p) = summary.peak_memory_bytes {
        println!("peak memory     {:.1} MiB", p as f64 / (1024.0 * 1024.0));
    }
    println!("layout          {}", summary.layout);
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
