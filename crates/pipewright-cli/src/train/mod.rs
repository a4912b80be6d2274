//! `pipewright train`: a reference model on a task, on one device or split over pipeline (pp),
//! tensor-parallel (tp) and data-parallel (dp) ranks: threads of this process, or processes
//! under mpirun. Every layout, serial included, trains through [`Varuna`].

mod args;
mod morph;
mod report;

use pipewright::comm::{local, Communicator};
use pipewright::data_parallel::DistributedLoader;
use pipewright::experiment::RunDir;
use pipewright::nn::optim::LrSchedule;
use pipewright::pipeline::schedule::Kind;
use pipewright::pipeline::{chrome_trace, Recompute, TraceEvent};
use pipewright::precision::Precision;
use pipewright::topology::Layout;
use pipewright::varuna::{Varuna, VarunaOptions};
use std::path::PathBuf;

use pipewright::{invalid, Batch, Error, Result, Sequential};
use pipewright_models::Task;

pub use args::make_optimizer;
use args::schedule;
pub use args::{make_model, make_task, positive, ModelConfig, TrainArgs};
use report::{train_loop, write_summary};

pub fn run(a: TrainArgs) -> Result<()> {
    // Ranks on this machine: the threads of this process, or MPI's processes on this node.
    // Under mpirun (or `pipewright launch`) every process is one rank.
    let mut a = a;
    if pipewright::dist::Env::under_mpi() {
        a.backend = crate::bench::Backend::Mpi;
    }
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
    let task = make_task(&a)?;
    let model_config = make_model(&a, task.as_ref())?;
    let (model, tied) = model_config.build()?;
    let restart = pipewright::dist::Env::from_env().restart;
    let resume = match a.resume.as_deref() {
        Some(r) => Some(resume_path(&a, r)?),
        // A restarted attempt of an elastic run goes on from its newest checkpoint, if any.
        None if restart > 0 => resume_path(&a, "latest").ok(),
        None => None,
    };
    let continuing = (a.resume.is_some() || restart > 0) && a.out.join("params.json").exists();
    let env = pipewright::dist::Env::from_env();
    if env.restart > 0 && env.world_size != a.pp * a.tp * a.dp {
        morph::morph(&mut a, &env, &model_config, &model)?;
    }
    let chunk_size = chunk_size(&a)?;
    let opts = VarunaOptions {
        shared_weights: tied.clone(),
        precision: a.precision.parse::<Precision>()?,
        seed: a.seed,
        schedule: a.schedule.parse::<Kind>()?,
        virtual_stages: a.virtual_stages,
        balance: balance(&a, task.as_ref(), &model, chunk_size)?,
        recompute: a.recompute.parse::<Recompute>()?,
        deferred_batch_norm: a.deferred_batch_norm,
        clip: (a.clip > 0.0).then_some(a.clip),
        lr: schedule(&a),
        ..VarunaOptions::new(Layout::new(a.pp, a.tp, a.dp)?, a.batch_size, chunk_size)
    };
    // Fail on a bad layout, split, schedule or device before anything is written.
    opts.validate(&model, a.pp * a.tp * a.dp)?;
    pipewright::device::device(&a.device, 0)?;
    if a.trace.is_some() && a.pp == 1 {
        return Err(invalid!(
            "--trace records pipeline actions: use it with --pp 2 or more"
        ));
    }
    let setup = Setup {
        a: &a,
        task: task.as_ref(),
        model: &model,
        tied: &tied,
        sched: opts.lr,
        chunk_size,
        opts: opts.clone(),
        meta: serde_json::json!({"args": &a, "model": model_config}),
        resume,
        continuing,
        stop: preemption_flag()?,
    };
    let traces = match a.backend {
        crate::bench::Backend::Mpi => return run_mpi(&setup),
        crate::bench::Backend::Local => {
            let dir = run_dir(&setup)?;
            let world = a.pp * a.tp * a.dp;
            local::run(world, |comm| {
                let (master, local_rank) = (comm.is_master(), comm.rank());
                setup.rank(Box::new(comm), local_rank, master.then_some(&dir))
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
    let (world, _guard) = pipewright::dist::init()?.into_parts();
    let a = setup.a;
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
            Some(run_dir(setup)?)
        } else {
            None
        };
        let local_rank = std::env::var("OMPI_COMM_WORLD_LOCAL_RANK")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let trace = setup.rank(world, local_rank, dir.as_ref())?;
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

/// A flag SIGTERM (a preemption notice) and SIGUSR1 (what `pipewright launch` forwards through
/// mpirun) set.
fn preemption_flag() -> Result<std::sync::Arc<std::sync::atomic::AtomicBool>> {
    let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGUSR1] {
        signal_hook::flag::register(sig, flag.clone())
            .map_err(|e| Error::io("cannot watch for signals", "SIGTERM", e))?;
    }
    Ok(flag)
}

/// The run directory: a new one, or the run being continued (resumed, or restarted by an
/// elastic launcher).
fn run_dir(setup: &Setup) -> Result<RunDir> {
    if setup.continuing {
        RunDir::open(&setup.a.out)
    } else {
        RunDir::create(&setup.a.out)
    }
}

/// Where checkpoints go: `--checkpoint-dir`, or `<out>/checkpoints`.
pub fn checkpoint_dir(a: &TrainArgs) -> PathBuf {
    a.checkpoint_dir
        .clone()
        .unwrap_or_else(|| a.out.join("checkpoints"))
}

/// The checkpoint `--resume` names (`latest`: the newest in the checkpoint directory).
fn resume_path(a: &TrainArgs, r: &str) -> Result<PathBuf> {
    let p = if r == "latest" {
        checkpoint_dir(a)
    } else {
        PathBuf::from(r)
    };
    pipewright::checkpoint::resolve(&p)
}

/// `--balance`: a list, or profiled by time or size on one micro-batch of the task.
fn balance(
    a: &TrainArgs,
    task: &dyn Task,
    model: &Sequential,
    chunk: usize,
) -> Result<Option<Vec<usize>>> {
    use pipewright::plan::{balance_by, By};
    let by = match a.balance.as_deref() {
        None => return Ok(None),
        Some("time" | "auto") => By::Time,
        Some("size") => By::Size,
        Some(list) => {
            let parsed = list
                .split(',')
                .map(|s| s.trim().parse::<usize>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|_| {
                    invalid!("--balance {list}: give layers per stage (3,2), time or size")
                })?;
            return Ok(Some(parsed));
        }
    };
    let (x, y) = task.batch(0, chunk)?;
    let build = pipewright::Build::cpu(a.seed);
    let stages = a.pp * a.virtual_stages;
    let b = balance_by(by, model, &build, &Batch::pair(x, y), stages)?;
    let list: Vec<String> = b.iter().map(|n| n.to_string()).collect();
    let by = format!("{by:?}").to_lowercase();
    println!(
        "balance by {by}: {} (layers or segments per stage)",
        list.join(",")
    );
    Ok(Some(b))
}

/// Rows of one micro-batch: `--chunk-size`, or the batch split over `--dp` replicas of
/// `--chunks` micro-batches each.
pub(crate) fn chunk_size(a: &TrainArgs) -> Result<usize> {
    if let Some(s) = a.chunk_size {
        return Ok(s);
    }
    let per = a.dp * a.chunks;
    if !a.batch_size.is_multiple_of(per) {
        return Err(invalid!(
            "--batch-size {} does not split into --dp {} replicas of --chunks {} equal \
             micro-batches: choose a batch size that is a multiple of {per}",
            a.batch_size,
            a.dp,
            a.chunks
        ));
    }
    Ok(a.batch_size / per)
}

/// Everything a rank needs to build its part and train.
pub struct Setup<'a> {
    a: &'a TrainArgs,
    task: &'a dyn Task,
    model: &'a Sequential,
    tied: &'a [(String, String)],
    sched: LrSchedule,
    chunk_size: usize,
    opts: VarunaOptions,
    /// What checkpoints store to rebuild the run (`ckpt reshard`, `ckpt export`).
    meta: serde_json::Value,
    resume: Option<PathBuf>,
    /// The run directory holds this run already: its scalars go on from the resumed step.
    continuing: bool,
    /// Set by SIGTERM or SIGUSR1: save at the end of the current step and stop.
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Setup<'_> {
    /// One rank of the world (`comm`): build its stages and shards, train on its replica's
    /// rows, return its trace if it is the first rank of its stage (the one traced).
    fn rank(
        &self,
        comm: Box<dyn Communicator>,
        local_rank: usize,
        dir: Option<&RunDir>,
    ) -> Result<Option<Vec<TraceEvent>>> {
        let a = self.a;
        let opts = VarunaOptions {
            device: pipewright::device::device(&a.device, local_rank)?,
            ..self.opts.clone()
        };
        let mut v = Varuna::new(self.model, comm, opts)?;
        v.set_optimizer(|ps| make_optimizer(a, ps))?;
        let start = match &self.resume {
            Some(p) => v.load_checkpoint(p)?.step,
            None => 0,
        };
        let traced = a.trace.is_some() && v.coords().tp_rank == 0 && v.coords().dp_rank == 0;
        if traced {
            v.keep_trace();
        }
        let c = v.coords();
        let task = self.task;
        let loader = DistributedLoader::new(
            |step, rows| task.batch(step, rows).map(|(x, y)| Batch::pair(x, y)),
            a.batch_size,
            c.dp_rank,
            a.dp,
            v.device().clone(),
        )?;
        let num_params = v.pipeline().total_params()?;
        let done = train_loop(
            self,
            num_params,
            &mut v,
            start,
            &|step| loader.batch(step),
            dir,
        )?;
        let bubbles = v.bubble_per_stage()?;
        if let (Some(dir), Some(done)) = (dir, done) {
            let balance: Vec<usize> = v.pipeline().ranges().iter().map(|r| r.len()).collect();
            write_summary(a, dir, done, &v.describe()?, &bubbles, &balance)?;
        }
        Ok(traced.then(|| v.take_trace()))
    }
}
