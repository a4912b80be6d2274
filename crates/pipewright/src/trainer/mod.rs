//! The front door: one call trains a model on its data as a [`TrainSpec`] says, to its end.
//!
//! A program describes a [`Run`]: the spec (layout, batch, schedule, precision, optimizer,
//! cadence), the model (any [`ModelSpec`]: a reference model or a user's
//! [`crate::trainer::model_spec::Custom`]), its loss, its data (the rows of each step's global batch, a
//! pure function of the step) and where it runs ([`Place`]). [`Trainer::new`] then does, once
//! per process and before anything is written, what every program needs:
//!
//! 1. A restarted attempt that finds a world of another size morphs the spec (Varuna's
//!    morphing, [`TrainSpec::morph_model`]): planned from the model's shapes on
//!    [`Place::machines`], else the layout nearest the old one.
//! 2. A balance by time or size is profiled on one micro-batch (each rank then takes rank 0's:
//!    timings differ between processes).
//! 3. Every check of the run: the layout against the world, the batch against the
//!    micro-batches, the schedule, the model's split, the device and the backend.
//! 4. The preemption flag (SIGTERM, SIGUSR1, SIGINT): every rank saves and stops together.
//!
//! Per rank, [`Trainer::start`] builds the rank's stages and shards on its device (its
//! collectives over NCCL when [`Place::backend`] asks), the optimizer, pretrained weights
//! ([`Place::pretrained`], by the model's Hugging Face names) and goes on from the newest
//! checkpoint when the run does; [`Trainer::fit`] runs the one training loop
//! ([`crate::trainer::fit()`]) with the program's [`crate::trainer::Hooks`].
//! [`Trainer::train`] does both on every rank: threads of this process, or this process's
//! rank under mpirun.

pub mod fit;
pub mod launch;
pub mod model_spec;
mod morph;
mod rank;
mod record;

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::distributed::comm::Backend;
use crate::engine::varuna::VarunaOptions;
use crate::model::batch::Batch;
use crate::model::Sequential;
use crate::parallel::loss::{CrossEntropy, SharedLoss};
use crate::plan::{Hardware, Morph};
use crate::trainer::model_spec::ModelSpec;
use crate::{invalid, Result};

pub use crate::engine::spec::{Balance, Cadence, TrainSpec};
pub use fit::{fit, FitReport, Hooks, StepDone};
pub use rank::{Batches, Losses, Started};
pub use record::Recorded;

pub use crate::engine::varuna::Data;

/// Where and how a run's ranks run.
#[derive(Clone, Debug)]
pub struct Place {
    /// `cpu`, `cuda` (each rank on the GPU of its local rank) or `cuda:N`.
    pub device: String,
    /// What carries the ranks' messages: threads of this process ([`Backend::Local`]), MPI
    /// processes, or NCCL between GPUs.
    pub backend: Backend,
    /// The machines a restart in a world of another size is planned for: the hardware and its
    /// ranks per node. Without them (or for a model without shapes) a restart takes the layout
    /// nearest the old one.
    pub machines: Option<(Hardware, usize)>,
    /// A Hugging Face model directory whose weights the run starts from (a checkpoint the run
    /// goes on from replaces them).
    pub pretrained: Option<PathBuf>,
    /// Where checkpoints go: `<run dir>/checkpoints` when `None`.
    pub checkpoint_dir: Option<PathBuf>,
}

impl Default for Place {
    /// On the CPU, ranks as threads, no machines to plan for, nothing pretrained.
    fn default() -> Self {
        Self {
            device: "cpu".into(),
            backend: Backend::Local,
            machines: None,
            pretrained: None,
            checkpoint_dir: None,
        }
    }
}

/// A run described whole: what [`Trainer::new`] takes.
#[derive(Clone)]
pub struct Run {
    /// Layout, batch, schedule, precision, optimizer, learning rate, seed and cadence.
    pub spec: TrainSpec,
    /// The model, which builds itself and gives its parallel rules, shapes and names.
    pub model: Arc<dyn ModelSpec + Send + Sync>,
    /// The objective on the last stage.
    pub loss: SharedLoss,
    /// The data, as rows of each step ([`Trainer::start`] gives each rank its share); `None`
    /// when the program's hooks give every batch themselves (a stateful loader it registers on
    /// its context, such as pystematic's [`crate::experiment::SmartDataLoader`]). Without it
    /// there is no sample to plan a restart from its shapes or to profile a balance on.
    pub data: Option<Data>,
    /// Where it runs.
    pub place: Place,
    /// The most rows an evaluation runs at once (all when `None`).
    pub eval_rows: Option<usize>,
    /// Fail at the first layer output holding a NaN or an inf (for debugging; costs a
    /// reduction per layer).
    pub detect_anomaly: bool,
}

impl Run {
    /// `model` trained on `data` as `spec` says, with cross-entropy against
    /// [`Batch::TARGETS`], on the CPU, ranks as threads.
    pub fn new(spec: TrainSpec, model: Arc<dyn ModelSpec + Send + Sync>, data: Data) -> Self {
        Self {
            spec,
            model,
            loss: Arc::new(CrossEntropy::default()),
            data: Some(data),
            place: Place::default(),
            eval_rows: None,
            detect_anomaly: false,
        }
    }

    /// `model` trained as `spec` says on batches the program's hooks give (see [`Run::data`]),
    /// with cross-entropy, on the CPU, ranks as threads.
    pub fn with_own_batches(spec: TrainSpec, model: Arc<dyn ModelSpec + Send + Sync>) -> Self {
        Self {
            spec,
            model,
            loss: Arc::new(CrossEntropy::default()),
            data: None,
            place: Place::default(),
            eval_rows: None,
            detect_anomaly: false,
        }
    }

    /// The run's data, or an error that says what needs it.
    fn need_data(&self, what: &str) -> Result<&Data> {
        self.data.as_ref().ok_or_else(|| {
            invalid!(
                "{what} needs the run's data, and this run has none (its hooks give the \
                 batches): give the run its data (Run::new)"
            )
        })
    }

    /// The dims of one input sample (the model's first input, its rows left out): what the
    /// model's shapes are sized for.
    pub fn sample(&self, model: &Sequential) -> Result<Vec<usize>> {
        let batch = (self.need_data("the model's sample")?)(0, 1)?;
        let name = model
            .input_names()
            .first()
            .cloned()
            .unwrap_or_else(|| Batch::INPUTS.to_string());
        let t = batch
            .get(&name)
            .ok_or_else(|| invalid!("the data's batches hold no `{name}`, the model's input"))?;
        Ok(t.dims().get(1..).unwrap_or_default().to_vec())
    }
}

/// A run ready to start on every rank: its spec resolved as this attempt runs it (morphed,
/// its balance measured), the model built, every check made.
pub struct Trainer {
    /// The run, its spec resolved.
    run: Run,
    model: Sequential,
    tied: Vec<(String, String)>,
    /// The balance was timed here: every rank takes rank 0's.
    timed: bool,
    morphed: Option<Morph>,
    stop: Arc<AtomicBool>,
}

impl Trainer {
    /// `run` prepared for an attempt in a world of `world` ranks (`None`: the spec's own
    /// layout); a world of another size morphs the spec (see the module's text). Every check
    /// of the run is made here, before any rank starts.
    pub fn new(mut run: Run, world: Option<usize>) -> Result<Self> {
        check_backend(&run.place, run.spec.world())?;
        let model = run.model.build()?;
        let mut morphed = None;
        if let Some(world) = world.filter(|w| *w != run.spec.world()) {
            // Planned from the model's shapes when there are machines to plan for and data to
            // size a sample by; else the nearest layout.
            let sample = match (&run.place.machines, &run.data) {
                (Some(_), Some(_)) => run.sample(&model)?,
                _ => Vec::new(),
            };
            let machines = (run.data.is_some())
                .then_some(run.place.machines.as_ref())
                .flatten()
                .map(|(hw, n)| (hw, *n));
            let (spec, m) = run
                .spec
                .morph_model(world, run.model.as_ref(), &sample, machines)?;
            run.spec = spec;
            morphed = Some(m);
        }
        run.spec.validate()?;
        let tied = run.model.tied();
        let timed = matches!(run.spec.pipeline.balance, Some(Balance::Time));
        if !matches!(run.spec.pipeline.balance, None | Some(Balance::Layers(_))) {
            let sample =
                (run.need_data("a balance by time or size")?)(0, run.spec.batch.micro_batch)?;
            run.spec = run.spec.resolve_balance(&model, &sample)?;
        }
        let trainer = Self {
            timed,
            stop: crate::distributed::preemption_flag()?,
            run,
            model,
            tied,
            morphed,
        };
        trainer
            .options()
            .validate(&trainer.model, trainer.run.spec.world())?;
        crate::runtime::device::device(&trainer.run.place.device, 0)?;
        Ok(trainer)
    }

    /// `run` prepared for this process's attempt: a launcher's restarted attempt
    /// (`PIPEWRIGHT_RESTART`) runs in the world it was given, morphing when that is another
    /// size; a first attempt in the spec's own layout.
    pub fn from_env(run: Run) -> Result<Self> {
        let env = crate::distributed::Env::from_env();
        Self::new(run, (env.restart > 0).then_some(env.world_size))
    }

    /// The run as this attempt trains it: morphed when it was, a balance by time or size
    /// resolved into layers per stage (by this process; under a timed balance every rank
    /// takes rank 0's when it starts).
    pub fn spec(&self) -> &TrainSpec {
        &self.run.spec
    }

    /// How the spec was morphed, and why, when it was.
    pub fn morphed(&self) -> Option<&Morph> {
        self.morphed.as_ref()
    }

    /// The model's layers.
    pub fn model(&self) -> &Sequential {
        &self.model
    }

    /// The model's tied parameter pairs.
    pub fn tied(&self) -> &[(String, String)] {
        &self.tied
    }

    /// The engine's options every rank starts from: the resolved spec, the model's tied
    /// pairs, the loss and the run's checks (on the CPU; each rank sets its device).
    fn options(&self) -> VarunaOptions {
        VarunaOptions {
            shared_weights: self.tied.clone(),
            loss: self.run.loss.clone(),
            detect_anomaly: self.run.detect_anomaly,
            ..VarunaOptions::of(self.run.spec.clone())
        }
    }

    /// Whether a preemption signal reached this process.
    pub fn stop_requested(&self) -> bool {
        self.stop.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Fails on a backend that cannot carry `world` ranks here: MPI outside mpirun, NCCL without
/// the `cuda` build or a GPU.
fn check_backend(place: &Place, world: usize) -> Result<()> {
    match place.backend {
        Backend::Mpi if world > 1 && !crate::distributed::Env::under_mpi() => Err(invalid!(
            "--backend mpi runs one process per rank: start it under `mpirun -np {world}`, or pass \
             --distributed to have pipewright start them (a build with `--features mpi`)"
        )),
        Backend::Nccl if !cfg!(feature = "cuda") => Err(invalid!(
            "--backend nccl needs a build with the `cuda` feature (tools/build-cuda.sh)"
        )),
        Backend::Nccl if !place.device.starts_with("cuda") => Err(invalid!(
            "--backend nccl moves GPU tensors: use it with --device cuda"
        )),
        _ => Ok(()),
    }
}
