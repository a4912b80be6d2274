//! `pipewright train`: a reference model on a task, on one device or split over pipeline (pp),
//! tensor-parallel (tp) and data-parallel (dp) ranks: threads of this process, or processes
//! under mpirun. Every layout, serial included, trains through [`Varuna`].

mod report;

use std::sync::Arc;

use pipewright::experiment::{Context, Experiment, Params, RunDir};
use pipewright::parallel::pipeline::{CommEvent, TraceEvent};
use pipewright::plan::StepParts;
use pipewright::trainer::Balance;
use pipewright::trainer::{Data, Place, Run, Trainer};

use pipewright::{invalid, Batch, Error, Result};
use pipewright_models::{RunSpec, Task};

pub use pipewright_models::flags::{finite, positive, positive_u64, TrainArgs};
use report::{train_loop, write_summary};

/// `pipewright train ARGS`: the experiment [`experiment`] on the flags `args`.
pub fn run(args: Vec<std::ffi::OsString>) -> Result<()> {
    let argv = std::iter::once("pipewright train".into()).chain(args);
    let params = match experiment(|_| Ok(())).parse(argv) {
        Err(Error::Help(text)) => {
            pipewright::runtime::console::say_text(&text);
            return Ok(());
        }
        p => p?,
    };
    let mut params = params;
    pipewright_models::flags::inherit_checkpointing(&mut params)?
        .into_iter()
        .for_each(note);
    // Every check of the flags before anything is written.
    let setup = Setup::new(&params)?;
    let traces = std::sync::Mutex::new(Vec::new());
    let run_dir = std::sync::Mutex::new(None);
    experiment(|cx| setup.rank(cx, &traces, &run_dir)).run(&params)?;
    // Under MPI each process holds its own ranks' traces: rank 0's is written.
    if pipewright::distributed::Env::from_env().rank == 0 {
        if setup.a.output.trace.is_some() && pipewright::distributed::Env::under_mpi() {
            eprintln!("note: under MPI the trace holds rank 0's actions only");
        }
        let mut traces = traces.into_inner().unwrap_or_default();
        // The ranks finish in any order: each lane is its stage's (the trace's tid).
        traces.sort_by_key(|t| t.0.first().map(|e| e.action.stage()));
        write_trace(&setup.a, &traces)?;
        let dir: Option<std::path::PathBuf> = run_dir.into_inner().unwrap_or_default();
        if let (true, Some(dir)) = (setup.a.output.report, dir) {
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

/// Says `text` on stderr once per job, on its first rank (every rank of a job reaches the
/// same notes).
fn note(text: String) {
    if pipewright::distributed::Env::from_env().rank == 0 {
        eprintln!("note: {text}");
    }
}

/// Each traced rank's actions and the data-parallel communication beside them.
type RankTrace = (Vec<TraceEvent>, Vec<CommEvent>);

fn write_trace(a: &TrainArgs, traces: &[RankTrace]) -> Result<()> {
    if let Some(path) = &a.output.trace {
        pipewright::parallel::pipeline::trace::write_chrome_trace(path, traces)?;
        pipewright::say!(
            "trace           {} (open in https://ui.perfetto.dev)",
            path.display()
        );
    }
    Ok(())
}

/// Everything a rank needs to build its part and train: made once per process from the
/// parameters, checking every flag before the run directory is made.
pub struct Setup {
    a: TrainArgs,
    /// The run the flags describe (morphed to the world of a restarted attempt).
    spec: RunSpec,
    task: Arc<dyn Task>,
    /// The library's front door, which morphs, checks, builds and trains every rank.
    trainer: Trainer,
    /// What checkpoints store to rebuild the run (`ckpt reshard`, `ckpt export`).
    meta: serde_json::Value,
    /// The run directory holds this run already: its scalars go on from the resumed step.
    continuing: bool,
    /// The machines `--hardware` names (morphing plans for them; the report's prediction).
    hw: pipewright::plan::Hardware,
    /// The run's ranks in this process: all of them as threads, the local ones under mpirun.
    here: usize,
}

impl Setup {
    /// The run `params` describe, checked.
    fn new(params: &Params) -> Result<Self> {
        let mut a: TrainArgs = params.args()?;
        if params.flag("cuda")? {
            a.parallel.device = "cuda".into();
        }
        let env = pipewright::distributed::Env::from_env();
        // Where a resumed or restarted run finds its checkpoints and scalars.
        let goes_on = a.checkpoint.resume.is_some() || env.restart > 0;
        if goes_on && a.output.out.is_none() {
            return Err(invalid!(
                "a resumed or restarted run goes on in its run directory: name it with --out DIR"
            ));
        }
        let continuing = goes_on
            && a.output
                .out
                .as_ref()
                .is_some_and(|o| o.join("params.json").exists());
        // The checkpoint must be there before the run directory is made.
        let checkpoints = a.checkpoint.checkpoint_dir.clone().unwrap_or_else(|| {
            let out = a.output.out.clone().unwrap_or_default();
            out.join("checkpoints")
        });
        let target = Context::resume_target(a.checkpoint.resume.as_deref(), &checkpoints)?;
        let (spec, task) = a.spec()?;
        if let Some(ck) = &target {
            spec.resumes_checkpoint(ck, a.checkpoint.resume.is_some())?
                .into_iter()
                .for_each(note);
        }
        // The machines a morph plans for: a wrong file fails now, not at the first restart.
        let hw = pipewright::plan::Hardware::load(&a.parallel.hardware)?;
        // Under mpirun each process holds its own ranks; as threads this one holds them all.
        let here = if pipewright::distributed::Env::under_mpi() {
            env.local_world_size
        } else {
            spec.train.world()
        };
        // Before the model is built: a billion layers' specs alone would not fit.
        spec.check_fits(&task.shape(), here)?;
        let task: Arc<dyn Task> = task.into();
        let run = Run {
            place: Place {
                device: a.parallel.device.clone(),
                backend: a.parallel.backend,
                machines: Some((hw.clone(), env.local_world_size)),
                pretrained: a.sizes.init_from.clone(),
                checkpoint_dir: a.checkpoint.checkpoint_dir.clone(),
            },
            detect_anomaly: params.flag("debug")?,
            eval_rows: Some(spec.eval_rows(&task.shape())?),
            ..Run::new(
                spec.train.clone(),
                Arc::new(spec.model.clone()),
                data(&task),
            )
        };
        let trainer = Trainer::from_env(run)?;
        if let Some(m) = trainer.morphed() {
            let line = m.describe(spec.train.parallel.layout, &a.parallel.hardware);
            eprintln!("pipewright train: {line}");
        }
        // From here the run is the trainer's: morphed, its balance resolved.
        let spec = RunSpec {
            train: trainer.spec().clone(),
            ..spec
        };
        // The balance `--balance time` or `size` resolved to.
        if let (0, Some(by @ (Balance::Time | Balance::Size))) = (env.rank, &a.pipeline.balance) {
            let said = spec.describe_balance()?.unwrap_or_default();
            pipewright::say!("balance by {by}: {said}");
        }
        let layout = spec.train.parallel.layout;
        if spec.train.parallel.zero != pipewright::parallel::zero::Zero::Off
            && layout.dp == 1
            && env.rank == 0
        {
            pipewright::say!(
                "note: --zero {} shards over data-parallel replicas and --dp is 1: nothing to \
                 shard, training without it",
                spec.train.parallel.zero
            );
        }
        if a.output.trace.is_some() && layout.pp == 1 {
            return Err(invalid!(
                "--trace records pipeline actions: use it with --pp 2 or more"
            ));
        }
        if let Some(t) = &a.output.trace {
            let ours = pipewright::parallel::pipeline::trace::is_chrome_trace;
            pipewright::runtime::files::ensure_replaceable(t, "--trace", "a pipeline trace", ours)?;
        }
        Ok(Self {
            meta: spec.to_meta()?,
            spec,
            task,
            trainer,
            continuing,
            hw,
            here,
            a,
        })
    }

    /// One rank of the run (`cx`): build its stages and shards, train on its replica's rows;
    /// the first rank of each stage adds its trace to `traces` when tracing.
    fn rank(
        &self,
        cx: &mut Context,
        traces: &std::sync::Mutex<Vec<RankTrace>>,
        run_dir: &std::sync::Mutex<Option<std::path::PathBuf>>,
    ) -> Result<()> {
        let a = &self.a;
        let started = self.trainer.start(cx)?;
        let v = cx.engine()?;
        let traced = a.output.trace.is_some() && v.coords().tp_rank == 0 && v.coords().dp_rank == 0;
        if traced {
            v.keep_trace();
        }
        let num_params = v.pipeline().total_params()?;
        let start = started.step;
        let dir = if cx.is_master() {
            Some(RunDir::open(cx.dir())?)
        } else {
            None
        };
        if let Some(d) = &dir {
            *run_dir.lock().map_err(|_| invalid!("a rank panicked"))? = Some(d.path().into());
            // The planner's prediction for this layout from the model's shapes, for the
            // report (a layout the planner refuses has none, and the report says so).
            if let Ok(p) = self.spec.predict(&self.hw, self.here, a.parallel.backend) {
                p.save(d.path())?;
            }
            if start > 0 {
                pipewright::say!(
                    "resumed from step-{start} ({} {}; {} steps to go)",
                    self.spec.train.parallel.layout,
                    a.precision,
                    self.spec.train.cadence.steps.saturating_sub(start)
                );
            }
        }
        let batches = started
            .batches
            .as_ref()
            .ok_or_else(|| invalid!("the run was built without its data"))?;
        let done = train_loop(
            self,
            num_params,
            cx,
            start,
            &|step| batches.batch(step),
            dir.as_ref(),
        )?;
        let v = cx.engine()?;
        let bubbles = v.bubble_per_stage()?;
        let exposed = v.exposed_comm_per_rank()?;
        if let (Some(dir), Some(done)) = (dir, done) {
            let balance: Vec<usize> = v.pipeline().ranges().iter().map(|r| r.len()).collect();
            let parts = StepParts::median_of(v.step_parts());
            let measured = (bubbles.as_slice(), exposed.as_slice());
            write_summary(self, &dir, done, &v.describe()?, measured, &balance, parts)?;
        }
        if traced {
            let mine = (v.take_trace(), v.take_comm_trace());
            traces
                .lock()
                .map_err(|_| invalid!("a rank panicked"))?
                .push(mine);
        }
        Ok(())
    }
}

/// The task's global batches as the trainer reads them.
fn data(task: &Arc<dyn Task>) -> Data {
    let task = task.clone();
    Arc::new(move |step, rows| task.batch(step, rows).map(|(x, y)| Batch::pair(x, y)))
}
