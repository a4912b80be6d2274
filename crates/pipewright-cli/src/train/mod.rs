//! `pipewright train`: a reference model on a task, on one device or split over pipeline (pp),
//! tensor-parallel (tp) and data-parallel (dp) ranks: threads of this process, or processes
//! under mpirun. Every layout, serial included, trains through [`Varuna`].

mod args;
mod model;
mod morph;
mod report;

use pipewright::data_parallel::DistributedLoader;
use pipewright::experiment::{Balance, Context, Experiment, Params, RunDir};
use pipewright::pipeline::{chrome_trace, TraceEvent};
use pipewright::plan::StepParts;
use pipewright::varuna::{Varuna, VarunaOptions};
use pipewright::ModelSpec;

use pipewright::{invalid, Batch, Error, Result, Sequential};
use pipewright_models::{RunSpec, Task, TaskSpec};

pub use args::{finite, positive, positive_u64, task_spec, TrainArgs};
use report::{train_loop, write_summary};

/// `pipewright train ARGS`: the experiment [`experiment`] on the flags `args`.
pub fn run(args: Vec<std::ffi::OsString>) -> Result<()> {
    let argv = std::iter::once("pipewright train".into()).chain(args);
    let params = match experiment(|_| Ok(())).parse(argv) {
        Err(Error::Help(text)) => {
            pipewright::console::say_text(&text);
            return Ok(());
        }
        p => p?,
    };
    let mut params = params;
    inherit_checkpointing(&mut params)?;
    // Every check of the flags before anything is written.
    let setup = Setup::new(&params)?;
    let traces = std::sync::Mutex::new(Vec::new());
    let run_dir = std::sync::Mutex::new(None);
    experiment(|cx| setup.rank(cx, &traces, &run_dir)).run(&params)?;
    // Under MPI each process holds its own ranks' traces: rank 0's is written.
    if pipewright::dist::Env::from_env().rank == 0 {
        if setup.a.trace.is_some() && pipewright::dist::Env::under_mpi() {
            eprintln!("note: under MPI the trace holds rank 0's actions only");
        }
        let mut traces = traces.into_inner().unwrap_or_default();
        // The ranks finish in any order: each lane is its stage's (the trace's tid).
        traces.sort_by_key(|t| t.first().map(|e| e.action.stage()));
        write_trace(&setup.a, &traces)?;
        let dir: Option<std::path::PathBuf> = run_dir.into_inner().unwrap_or_default();
        if let (true, Some(dir)) = (setup.a.report, dir) {
            let out = dir.join("report.html");
            pipewright::experiment::write_report(&[dir.as_path()], &out)?;
            pipewright::say!("report          {}", out.display());
        }
    }
    Ok(())
}

/// `pipewright train` as an experiment: the flags of [`TrainArgs`] beside pystematic's
/// standard parameters (`--seed` is `--random-seed`, `--resume` is `--checkpoint`, `--out`
/// the run directory itself), as many ranks as the layout has, `body` run by each.
pub fn experiment<F>(body: F) -> Experiment<F>
where
    F: Fn(&mut Context) -> Result<()> + Sync,
{
    Experiment::new("train", body)
        .about(
            "Train a reference model on a generated task, on one device or split over pipeline \
             (pp), tensor-parallel (tp), context-parallel (cp) and data-parallel (dp) ranks, into \
             a run directory.",
        )
        .args::<TrainArgs>()
        .alias("random_seed", "seed")
        .alias("checkpoint", "resume")
        .run_dir("out")
        .world(|p| {
            let a: TrainArgs = p.args()?;
            Ok(a.world())
        })
        .subcommand(&["train"])
}

/// A resume (`--resume`) without `--checkpoint-every` goes on checkpointing as its run did:
/// the interval (and `--keep`, unless given) that the run directory's `parameters.json`
/// recorded, said once on stderr. Without this a resume stopped checkpointing and recorded 0,
/// so the next resume started from the step before it.
fn inherit_checkpointing(params: &mut Params) -> Result<()> {
    let (Some(_), Some(out)) = (params.string("checkpoint")?, params.string("out")?) else {
        return Ok(());
    };
    if params.int("checkpoint_every")? != 0 {
        return Ok(());
    }
    let recorded = std::fs::read_to_string(std::path::Path::new(&out).join("parameters.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
    let Some(old) = recorded else { return Ok(()) };
    let Some(every) = old["checkpoint_every"].as_u64().filter(|&n| n > 0) else {
        return Ok(());
    };
    params.set("checkpoint_every", every.into())?;
    let mut keep = String::new();
    if params.to_json()["keep"].is_null() {
        if let Some(k) = old["keep"].as_u64() {
            params.set("keep", k.into())?;
            keep = format!(", keeping the newest {k}");
        }
    }
    if pipewright::dist::Env::from_env().rank == 0 {
        eprintln!(
            "note: checkpointing every {every} steps{keep}, as the run did (its parameters.json); \
             --checkpoint-every changes it"
        );
    }
    Ok(())
}

/// Fails when the run cannot go on from the checkpoint `ck`: a resume asked for by hand with
/// no steps left (it would end at once and rewrite the run's scalars and summary with
/// nothing), or token shards of another tokenizer than the checkpoint's run trained on.
fn check_resume(a: &TrainArgs, spec: &RunSpec, ck: &std::path::Path) -> Result<()> {
    let r = pipewright::checkpoint::Reader::open(ck)?;
    let (at, steps) = (r.manifest().step, spec.train.cadence.steps);
    if a.resume.is_some() && at >= steps {
        return Err(invalid!(
            "`{}` holds step {at} and --steps is {steps}: nothing is left to train (a resumed \
             run ends at --steps, counted from the first step): give --steps above {at}",
            ck.display()
        ));
    }
    // Checkpoints from before runs recorded their spec recorded no tokenizer either.
    let Ok(stored) = RunSpec::from_meta(&r.manifest().meta) else {
        return Ok(());
    };
    if let (
        TaskSpec::Tokens {
            tokenizer_sha256: now,
            ..
        },
        TaskSpec::Tokens {
            tokenizer_sha256: then,
            ..
        },
    ) = (&spec.task, &stored.task)
    {
        if !then.is_empty() && now != then {
            return Err(invalid!(
                "`{}` was trained on ids of another tokenizer (sha256 {}) than the shards of \
                 --data hold (sha256 {}): resume on the shards of its tokenizer",
                ck.display(),
                &then[..then.len().min(12)],
                &now[..now.len().min(12)]
            ));
        }
    }
    Ok(())
}

fn write_trace(a: &TrainArgs, traces: &[Vec<TraceEvent>]) -> Result<()> {
    if let Some(path) = &a.trace {
        std::fs::write(path, chrome_trace(traces))
            .map_err(|e| Error::io("cannot write trace", path, e))?;
        pipewright::say!(
            "trace           {} (open in https://ui.perfetto.dev)",
            path.display()
        );
    }
    Ok(())
}

/// The run's communicator over NCCL when `--backend nccl` asks for it (Setup checked that the
/// device is a GPU): the ranks join through `world`, each on its own GPU.
#[cfg(feature = "cuda")]
fn nccl_world(
    a: &TrainArgs,
    world: Box<dyn pipewright::comm::Communicator>,
    device: &pipewright::candle_core::Device,
) -> Result<Box<dyn pipewright::comm::Communicator>> {
    match (a.backend, device.location()) {
        (
            pipewright::comm::Backend::Nccl,
            pipewright::candle_core::DeviceLocation::Cuda { gpu_id },
        ) => Ok(Box::new(pipewright::comm::nccl::NcclComm::new(
            world, gpu_id,
        )?)),
        _ => Ok(world),
    }
}

/// Everything a rank needs to build its part and train: made once per process from the
/// parameters, checking every flag before the run directory is made.
pub struct Setup {
    a: TrainArgs,
    /// The run the flags describe (morphed to the world of a restarted attempt).
    spec: RunSpec,
    task: Box<dyn Task>,
    model: Sequential,
    tied: Vec<(String, String)>,
    opts: VarunaOptions,
    /// The balance was timed here: every rank takes rank 0's (timings differ by process).
    timed: bool,
    /// What checkpoints store to rebuild the run (`ckpt reshard`, `ckpt export`).
    meta: serde_json::Value,
    /// The run directory holds this run already: its scalars go on from the resumed step.
    continuing: bool,
    /// Set by SIGTERM or SIGUSR1: save at the end of the current step and stop.
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Setup {
    /// The run `params` describe, checked.
    fn new(params: &Params) -> Result<Self> {
        let mut a: TrainArgs = params.args()?;
        if params.flag("cuda")? {
            a.device = "cuda".into();
        }
        let env = pipewright::dist::Env::from_env();
        if matches!(a.backend, pipewright::comm::Backend::Mpi)
            && !pipewright::dist::Env::under_mpi()
            && a.world() > 1
        {
            return Err(invalid!(
                "--backend mpi runs one process per rank: start it under `mpirun -np {}`, or pass \
                 --distributed to have pipewright start them (a build with `--features mpi`)",
                a.world()
            ));
        }
        if matches!(a.backend, pipewright::comm::Backend::Nccl) {
            if !cfg!(feature = "cuda") {
                return Err(invalid!(
                    "--backend nccl needs a build with the `cuda` feature (tools/build-cuda.sh)"
                ));
            }
            if !a.device.starts_with("cuda") {
                return Err(invalid!(
                    "--backend nccl moves GPU tensors: use it with --device cuda"
                ));
            }
        }
        // Where a resumed or restarted run finds its checkpoints and scalars.
        let goes_on = a.resume.is_some() || env.restart > 0;
        if goes_on && a.out.is_none() {
            return Err(invalid!(
                "a resumed or restarted run goes on in its run directory: name it with --out DIR"
            ));
        }
        let continuing = goes_on
            && a.out
                .as_ref()
                .is_some_and(|o| o.join("params.json").exists());
        // The checkpoint must be there before the run directory is made.
        let checkpoints = a.checkpoint_dir.clone().unwrap_or_else(|| {
            let out = a.out.clone().unwrap_or_default();
            out.join("checkpoints")
        });
        let target = Context::resume_target(a.resume.as_deref(), &checkpoints)?;
        let (mut spec, task) = a.spec()?;
        if let Some(ck) = &target {
            check_resume(&a, &spec, ck)?;
        }
        // The machines a morph plans for: a wrong file fails now, not at the first restart.
        pipewright::plan::Hardware::load(&a.hardware)?;
        // Under mpirun each process holds its own ranks; as threads this one holds them all.
        let here = if pipewright::dist::Env::under_mpi() {
            env.local_world_size
        } else {
            spec.train.world()
        };
        // Before the model is built: a billion layers' specs alone would not fit.
        spec.check_fits(&task.shape(), here)?;
        let (model, tied) = (spec.model.build()?, spec.model.tied());
        if env.restart > 0 && env.world_size != spec.train.world() {
            spec = morph::morph(&a, &env, &spec)?;
            let l = spec.train.layout;
            (a.pp, a.tp, a.cp, a.dp) = (l.pp, l.tp, l.cp, l.dp);
            a.chunk_size = Some(spec.train.micro_batch);
            if spec.train.balance.is_none() {
                a.balance = None;
            }
        }
        let mut opts = spec.varuna_options(&model, task.as_ref())?;
        opts.detect_anomaly = params.flag("debug")?;
        let by = match spec.train.balance {
            Some(Balance::Time) => Some("time"),
            Some(Balance::Size) => Some("size"),
            _ => None,
        };
        if let (Some(by), Some(b), 0) = (by, &opts.balance, env.rank) {
            let list: Vec<String> = b.iter().map(|n| n.to_string()).collect();
            pipewright::say!(
                "balance by {by}: {} (layers or segments per stage)",
                list.join(",")
            );
        }
        // Fail on a bad layout, split, schedule or device before anything is written.
        opts.validate(&model, a.world())?;
        if opts.zero != pipewright::zero::Zero::Off && a.dp == 1 && env.rank == 0 {
            pipewright::say!(
                "note: --zero {} shards over data-parallel replicas and --dp is 1: nothing to \
                 shard, training without it",
                opts.zero
            );
        }
        pipewright::device::device(&a.device, 0)?;
        if a.trace.is_some() && a.pp == 1 {
            return Err(invalid!(
                "--trace records pipeline actions: use it with --pp 2 or more"
            ));
        }
        if let Some(t) = &a.trace {
            let ours = pipewright::pipeline::trace::is_chrome_trace;
            pipewright::files::ensure_replaceable(t, "--trace", "a pipeline trace", ours)?;
        }
        Ok(Self {
            timed: matches!(spec.train.balance, Some(Balance::Time)),
            meta: spec.to_meta()?,
            spec,
            task,
            model,
            tied,
            opts,
            continuing,
            stop: pipewright::dist::preemption_flag()?,
            a,
        })
    }

    /// One rank of the run (`cx`): build its stages and shards, train on its replica's rows;
    /// the first rank of each stage adds its trace to `traces` when tracing.
    fn rank(
        &self,
        cx: &mut Context,
        traces: &std::sync::Mutex<Vec<Vec<TraceEvent>>>,
        run_dir: &std::sync::Mutex<Option<std::path::PathBuf>>,
    ) -> Result<()> {
        let a = &self.a;
        let world = a.world();
        if cx.get_num_processes() != world {
            return Err(invalid!(
                "the job has {} ranks but --pp {} x --tp {} x --cp {} x --dp {} needs {world}: start \
                 it with mpirun -np {world}",
                cx.get_num_processes(),
                a.pp,
                a.tp,
                a.cp,
                a.dp
            ));
        }
        let env = pipewright::dist::Env::from_env();
        let local_rank = if pipewright::dist::Env::under_mpi() {
            env.local_rank
        } else {
            cx.get_rank()
        };
        let mut opts = VarunaOptions {
            device: pipewright::device::device(&a.device, local_rank)?,
            ..self.opts.clone()
        };
        if let (true, Some(b)) = (self.timed, &opts.balance) {
            let mine = pipewright::candle_core::Tensor::new(
                b.iter().map(|n| *n as u32).collect::<Vec<_>>(),
                &pipewright::candle_core::Device::Cpu,
            )?;
            let rank0 = cx.broadcast_from_master(&mine)?.to_vec1::<u32>()?;
            opts.balance = Some(rank0.into_iter().map(|n| n as usize).collect());
        }
        let world = cx.world()?;
        #[cfg(feature = "cuda")]
        let world = nccl_world(a, world, &opts.device)?;
        let mut v = Varuna::new(&self.model, world, opts)?;
        v.set_eval_rows(self.spec.eval_rows(&self.task.shape())?);
        v.set_optimizer(|ps| self.spec.train.optimizer(ps, &self.tied))?;
        // Pretrained weights first; a checkpoint the run goes on from replaces them.
        if let Some(dir) = &a.init_from {
            let model = &self.spec.model;
            v.load_pretrained(dir, &|n| model.hf_names(n))?;
        }
        let traced = a.trace.is_some() && v.coords().tp_rank == 0 && v.coords().dp_rank == 0;
        if traced {
            v.keep_trace();
        }
        let c = v.coords();
        let num_params = v.pipeline().total_params()?;
        let task = self.task.as_ref();
        let loader = DistributedLoader::new(
            |step, rows| task.batch(step, rows).map(|(x, y)| Batch::pair(x, y)),
            a.batch_size,
            c.dp_rank,
            a.dp,
            v.device().clone(),
        )?;
        if let Some(d) = &a.checkpoint_dir {
            cx.set_checkpoint_dir(d)?;
        }
        let start = cx.set_trainer(v)?;
        let dir = if cx.is_master() {
            Some(RunDir::open(cx.dir())?)
        } else {
            None
        };
        if let Some(d) = &dir {
            *run_dir.lock().map_err(|_| invalid!("a rank panicked"))? = Some(d.path().into());
            // The planner's prediction for this layout from the model's shapes, for the
            // report (a layout the planner refuses has none, and the report says so).
            let hw = pipewright::plan::Hardware::load(&a.hardware)?;
            let per_node = if pipewright::dist::Env::under_mpi() {
                env.local_world_size
            } else {
                a.world()
            };
            if let Ok(p) = self.spec.predict(&hw, per_node) {
                p.save(d.path())?;
            }
            if start > 0 {
                pipewright::say!(
                    "resumed from step-{start} ({} {}; {} steps to go)",
                    self.spec.train.layout,
                    a.precision,
                    self.spec.train.cadence.steps.saturating_sub(start)
                );
            }
        }
        let done = train_loop(
            self,
            num_params,
            cx,
            start,
            &|step| loader.batch(step),
            dir.as_ref(),
        )?;
        let v = cx.trainer()?;
        let bubbles = v.bubble_per_stage()?;
        if let (Some(dir), Some(done)) = (dir, done) {
            let balance: Vec<usize> = v.pipeline().ranges().iter().map(|r| r.len()).collect();
            let parts = StepParts::median_of(v.step_parts());
            write_summary(a, &dir, done, &v.describe()?, &bubbles, &balance, parts)?;
        }
        if traced {
            let mine = v.take_trace();
            traces
                .lock()
                .map_err(|_| invalid!("a rank panicked"))?
                .push(mine);
        }
        Ok(())
    }
}
