//! One rank of a [`Trainer`]'s run: its part built and restored ([`Trainer::start`]), the
//! loop with the program's hooks ([`Trainer::fit`]), and every rank of the run at once
//! ([`Trainer::train`]).

use std::path::Path;

use candle_core::{Device, Tensor};

use super::fit::{fit, FitReport, Hooks, StepDone};
use super::record::Recorded;
use super::Trainer;
use crate::distributed::comm::Communicator;
use crate::engine::spec::Balance;
use crate::engine::varuna::{Varuna, VarunaOptions};
use crate::experiment::params::standard;
use crate::experiment::{Context, Params, Recorder};
use crate::model::batch::Batch;
use crate::parallel::data_parallel::ReplicaBatches;
use crate::{invalid, Result};

/// The tag [`Trainer::train`] records the hooks' metric under.
pub const METRIC_TAG: &str = "eval/metric";

/// A rank's rows of every global batch, on its device.
pub type Batches = ReplicaBatches<Box<dyn Fn(u64, usize) -> Result<Batch> + Send + Sync>>;

/// What [`Trainer::start`] gives a rank.
pub struct Started {
    /// The step training goes on from (0 for a new run, else the restored checkpoint's).
    pub step: u64,
    /// The rank's rows of each step's batch (`None` when the run has no data of its own:
    /// the program's hooks give the batches).
    pub batches: Option<Batches>,
}

impl Trainer {
    /// Builds rank `cx`'s part of the run and sets it as the context's step engine: its stages
    /// and shards on its device, the optimizer, pretrained weights, then the checkpoint the
    /// run goes on from (the context's `checkpoint` parameter, or a restarted attempt's newest).
    /// Collective: every rank of the run calls it.
    pub fn start(&self, cx: &mut Context) -> Result<Started> {
        let world = self.run.spec.world();
        if cx.get_num_processes() != world {
            return Err(invalid!(
                "the job has {} ranks but the layout {} needs {world}: start it with mpirun -np \
                 {world}",
                cx.get_num_processes(),
                self.run.spec.parallel.layout
            ));
        }
        let env = crate::distributed::Env::from_env();
        let local_rank = if crate::distributed::Env::under_mpi() {
            env.local_rank
        } else {
            cx.get_rank()
        };
        let mut opts = VarunaOptions {
            device: crate::runtime::device::device(&self.run.place.device, local_rank)?,
            ..self.options()
        };
        if let (true, Some(Balance::Layers(b))) = (self.timed, &opts.spec.pipeline.balance) {
            let mine = Tensor::new(
                b.iter().map(|n| *n as u32).collect::<Vec<_>>(),
                &Device::Cpu,
            )?;
            let rank0 = cx.broadcast_from_master(&mine)?.to_vec1::<u32>()?;
            opts.spec.pipeline.balance = Some(Balance::Layers(
                rank0.into_iter().map(|n| n as usize).collect(),
            ));
        }
        let comm = self.world(cx, &opts.device)?;
        let mut v = Varuna::new(&self.model, comm, opts)?;
        if let Some(rows) = self.run.eval_rows {
            v.set_eval_rows(rows);
        }
        v.set_optimizer(|ps| self.run.spec.optimizer(ps, &self.tied))?;
        if let Some(dir) = &self.run.place.pretrained {
            let model = &self.run.model;
            v.load_pretrained(dir, &|n| model.hf_names(n))?;
        }
        let batches = match self.run.data.clone() {
            Some(data) => Some(ReplicaBatches::new(
                Box::new(move |step, rows| data(step, rows)) as Box<_>,
                self.run.spec.batch.global_batch,
                v.coords().dp_rank,
                self.run.spec.parallel.layout.dp,
                v.device().clone(),
            )?),
            None => None,
        };
        if let Some(d) = &self.run.place.checkpoint_dir {
            cx.set_checkpoint_dir(d)?;
        }
        let step = cx.set_engine(v)?;
        Ok(Started { step, batches })
    }

    /// The communicator a rank trains over: the context's world, through NCCL when the
    /// place's backend asks for it (each rank on its own GPU).
    fn world(&self, cx: &Context, device: &Device) -> Result<Box<dyn Communicator>> {
        let world = cx.world()?;
        #[cfg(feature = "cuda")]
        if let (
            crate::distributed::comm::Backend::Nccl,
            candle_core::DeviceLocation::Cuda { gpu_id },
        ) = (self.run.place.backend, device.location())
        {
            return Ok(Box::new(crate::distributed::comm::nccl::NcclComm::new(
                world, gpu_id,
            )?));
        }
        let _ = device;
        Ok(world)
    }

    /// Trains the context's step engine (after [`Trainer::start`]) to the spec's last step with
    /// `hooks`, every rank saving and stopping together at a preemption signal. Collective.
    pub fn fit(&self, cx: &mut Context, hooks: &mut dyn Hooks) -> Result<FitReport> {
        let mut hooks = Preemptible { hooks, of: self };
        fit(cx, &self.run.spec.cadence, &mut hooks)
    }

    /// Runs every rank of the run in the run directory `dir`: threads of this process, or
    /// this process's rank when mpirun started it. `checkpoint` says what the run goes on
    /// from (a checkpoint, a directory of them, or `latest`; `None`: a new run, or a restarted
    /// attempt's newest). Each rank starts ([`Trainer::start`]), makes its hooks with `hooks`
    /// from what it started with, and fits; rank 0 keeps the run's record in `dir`
    /// ([`Recorded`]: loss, learning rate, the hooks' metric under `eval/metric`, step seconds
    /// and rows per second). Returns each of this process's ranks' report and hooks, in rank
    /// order.
    pub fn train<H, F>(
        &self,
        dir: &Path,
        checkpoint: Option<&str>,
        hooks: F,
    ) -> Result<Vec<(FitReport, H)>>
    where
        H: Hooks + Send,
        F: Fn(Started) -> H + Sync,
    {
        let mut params = Params::defaults(&standard());
        if let Some(c) = checkpoint {
            params.set("checkpoint", c.into())?;
        }
        let rank = |comm: Box<dyn Communicator>| -> Result<(FitReport, H)> {
            let mut cx = Context::new(params.clone(), dir, comm)?;
            let started = self.start(&mut cx)?;
            let rec = match (cx.is_master(), started.step) {
                (false, _) => None,
                (true, 0) => Some(Recorder::create(dir, METRIC_TAG)?),
                // Rows of the steps after the checkpoint go: they are recorded again.
                (true, step) => Some(Recorder::resume(dir, METRIC_TAG, step + 1)?),
            };
            let mut h = hooks(started);
            let spec = &self.run.spec;
            let scaled = spec.precision.scales_loss();
            let mut recorded = Recorded::new(&mut h, rec, spec.batch.global_batch, scaled);
            let report = self.fit(&mut cx, &mut recorded)?;
            recorded.finish()?;
            Ok((report, h))
        };
        if crate::distributed::Env::under_mpi() {
            let (comm, _guard) = crate::distributed::init()?.into_parts();
            return Ok(vec![rank(comm)?]);
        }
        crate::distributed::comm::local::run(self.run.spec.world(), |c| rank(Box::new(c)))
    }
}

/// The simplest hooks: the rank's batches, and each step's loss kept (a program that records
/// nothing else, a test against serial training).
pub struct Losses {
    /// The rank's rows of each step (the run's data; none when the run has none).
    pub batches: Option<Batches>,
    /// Each step's loss, in order (the same on every rank).
    pub losses: Vec<f64>,
}

impl Losses {
    /// No losses yet, batches from `started`.
    pub fn new(started: Started) -> Self {
        Self {
            batches: started.batches,
            losses: Vec::new(),
        }
    }
}

impl Hooks for Losses {
    fn batch(&mut self, _: &mut Context, step: u64) -> Result<Batch> {
        match &self.batches {
            Some(b) => b.batch(step),
            None => Err(invalid!(
                "the run has no data of its own, and Losses reads only the run's data: give \
                 the run its data (Run::new) or hooks that give the batches"
            )),
        }
    }

    fn after_step(&mut self, _: &mut Context, done: &StepDone) -> Result<()> {
        self.losses.push(done.outcome.loss);
        Ok(())
    }
}

impl Trainer {
    /// [`Trainer::train`] with [`Losses`]: rank 0's loss of every step this attempt took.
    pub fn losses(&self, dir: &Path, checkpoint: Option<&str>) -> Result<Vec<f64>> {
        let mut ranks = self.train(dir, checkpoint, Losses::new)?;
        Ok(ranks.swap_remove(0).1.losses)
    }
}

/// A program's hooks with the process's preemption flag: a signal stops the run as the
/// program's own request does.
struct Preemptible<'a> {
    hooks: &'a mut dyn Hooks,
    of: &'a Trainer,
}

impl Hooks for Preemptible<'_> {
    fn batch(&mut self, cx: &mut Context, step: u64) -> Result<Batch> {
        self.hooks.batch(cx, step)
    }

    fn evaluate(&mut self, cx: &mut Context, steps: u64) -> Result<Option<f64>> {
        self.hooks.evaluate(cx, steps)
    }

    fn metric_parts(&mut self) -> Vec<(String, f64)> {
        self.hooks.metric_parts()
    }

    fn after_step(&mut self, cx: &mut Context, done: &StepDone) -> Result<()> {
        self.hooks.after_step(cx, done)
    }

    fn checkpoint(&mut self, cx: &mut Context, steps: u64, background: bool) -> Result<()> {
        self.hooks.checkpoint(cx, steps, background)
    }

    fn stop_requested(&self) -> bool {
        self.hooks.stop_requested() || self.of.stop_requested()
    }
}
