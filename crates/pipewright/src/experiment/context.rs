//! pystematic's `Context`: everything of a training session in one place. Register named
//! [`Stateful`] items (the data loader, counters, random streams, a recorder's position) and
//! the training step ([`Varuna`]); [`Context::checkpoint`] saves all of them together (the
//! engine's checkpoint, the items' states in its `state.json`), and a run started with the
//! `checkpoint` parameter restores each as it is registered, so that the experiment goes on
//! where it stopped. The distributed helpers (`is_master`, `get_rank`, ...) answer for the
//! rank the context belongs to.

use std::any::Any;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use serde_json::{json, Value};

use super::loader::{Dataset, SmartDataLoader};
use super::params::Params;
use crate::distributed::comm::Communicator;
use crate::engine::checkpoint::CheckpointOptions;
use crate::engine::varuna::Varuna;
use crate::{invalid, Error, Result};

/// A value whose state a checkpoint of the context saves and restores.
pub trait Stateful: Any + Send {
    /// The state, as JSON.
    fn state_dict(&self) -> Result<Value>;
    /// Goes back to a state given by [`Stateful::state_dict`].
    fn load_state_dict(&mut self, state: &Value) -> Result<()>;

    /// Moves what the item holds to `device` ([`Context::cpu`], [`Context::cuda`]); nothing
    /// by default.
    fn to_device(&mut self, device: &Device) -> Result<()> {
        let _ = device;
        Ok(())
    }
}

impl<D: Dataset + 'static> Stateful for SmartDataLoader<D> {
    fn state_dict(&self) -> Result<Value> {
        Ok(SmartDataLoader::state_dict(self))
    }

    fn load_state_dict(&mut self, state: &Value) -> Result<()> {
        SmartDataLoader::load_state_dict(self, state)
    }

    fn to_device(&mut self, device: &Device) -> Result<()> {
        self.to(device.clone());
        Ok(())
    }
}

/// A counter (an epoch, a step) kept by the context.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counter(pub u64);

impl Stateful for Counter {
    fn state_dict(&self) -> Result<Value> {
        Ok(json!(self.0))
    }

    fn load_state_dict(&mut self, state: &Value) -> Result<()> {
        self.0 = state
            .as_u64()
            .ok_or_else(|| invalid!("a counter's state is a number, not {state}"))?;
        Ok(())
    }
}

/// One rank's session: its parameters, run directory, communicator, registered items and
/// step engine.
pub struct Context {
    params: Params,
    dir: PathBuf,
    comm: Box<dyn Communicator>,
    device: Device,
    items: BTreeMap<String, Box<dyn Stateful>>,
    engine: Option<Varuna>,
    /// Where [`Context::checkpoint`] saves (`<run dir>/checkpoints` unless set).
    checkpoint_dir: PathBuf,
    /// The first rank's lock of a checkpoint directory set apart from the run directory.
    checkpoint_lock: Option<super::RunLock>,
    /// Item states of the checkpoint being restored, for items not yet registered.
    pending: BTreeMap<String, Value>,
}

impl Context {
    /// The context of the rank `comm` speaks for, with the run's `params` and directory.
    pub fn new(params: Params, dir: &Path, comm: Box<dyn Communicator>) -> Result<Self> {
        let device = if params.flag("cuda")? {
            crate::runtime::device::device("cuda", comm.rank())?
        } else {
            Device::Cpu
        };
        Ok(Self {
            params,
            dir: dir.to_path_buf(),
            comm,
            device,
            items: BTreeMap::new(),
            engine: None,
            checkpoint_dir: dir.join("checkpoints"),
            checkpoint_lock: None,
            pending: BTreeMap::new(),
        })
    }

    /// The run's parameters.
    pub fn params(&self) -> &Params {
        &self.params
    }

    /// The run's directory (every rank sees the same).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where this rank computes.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Moves every registered item to the CPU, and makes it the device of what comes next
    /// (pystematic's `cpu()`; a step engine is built for its device: make it after).
    pub fn cpu(&mut self) -> Result<()> {
        self.move_to(Device::Cpu)
    }

    /// Moves every registered item to this rank's GPU, and makes it the device of what comes
    /// next (pystematic's `cuda()`).
    pub fn cuda(&mut self) -> Result<()> {
        self.move_to(crate::runtime::device::device("cuda", self.comm.rank())?)
    }

    fn move_to(&mut self, device: Device) -> Result<()> {
        for item in self.items.values_mut() {
            item.to_device(&device)?;
        }
        self.device = device;
        Ok(())
    }

    /// A communicator over every rank of the run, to give a step engine.
    pub fn world(&self) -> Result<Box<dyn Communicator>> {
        self.comm.split(&(0..self.comm.size()).collect::<Vec<_>>())
    }

    /// Registers `item` as `name`; restored at once when the run resumes a checkpoint that
    /// holds it.
    pub fn register<T: Stateful>(&mut self, name: &str, mut item: T) -> Result<()> {
        if let Some(state) = self.pending.remove(name) {
            item.load_state_dict(&state)?;
        }
        self.items.insert(name.to_string(), Box::new(item));
        Ok(())
    }

    /// The item registered as `name`.
    pub fn get<T: Stateful>(&mut self, name: &str) -> Result<&mut T> {
        let item = self
            .items
            .get_mut(name)
            .ok_or_else(|| invalid!("the context holds no item `{name}`"))?;
        (item.as_mut() as &mut dyn Any)
            .downcast_mut::<T>()
            .ok_or_else(|| invalid!("the context's item `{name}` is of another type"))
    }

    /// Saves checkpoints into `dir` instead of `<run dir>/checkpoints` (set it before
    /// [`Context::set_engine`], which looks there for `latest`). The directory belongs to this
    /// run while it lasts (the first rank holds its lock, as it holds the run directory's): a
    /// second run saving there would prune the first's checkpoints and move its `latest`. A
    /// directory inside another run's directory is refused, and so is one that another run
    /// saved into before, or that holds other files ([`super::owner`]).
    pub fn set_checkpoint_dir(&mut self, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io("cannot create checkpoint directory", dir, e))?;
        let (real, own) = (canonical(dir)?, canonical(&self.dir)?);
        if let Some(other) = real
            .ancestors()
            .find(|a| *a != own && super::RunDir::holds_run(a))
        {
            return Err(invalid!(
                "--checkpoint-dir `{}` is inside `{}`, the directory of another run: give this \
                 run's checkpoints a directory of their own",
                dir.display(),
                other.display()
            ));
        }
        if self.is_master() {
            self.checkpoint_lock = Some(super::RunLock::acquire(dir)?);
            let me = super::owner::claim_run_dir(&self.dir)?;
            super::owner::claim_checkpoint_dir(dir, &me, self.params.goes_on()?)?;
        }
        self.checkpoint_dir = dir.to_path_buf();
        Ok(())
    }

    /// The checkpoint the run goes on from ([`Context::resume_target`] of the `checkpoint`
    /// parameter and the checkpoint directory).
    pub fn resume_from(&self) -> Result<Option<PathBuf>> {
        let spec = self.params.string("checkpoint")?;
        Self::resume_target(spec.as_deref(), &self.checkpoint_dir)
    }

    /// The checkpoint a run given `checkpoint` goes on from: a checkpoint, a directory of
    /// them, or `latest` (the newest intact one in `checkpoint_dir`,
    /// [`crate::engine::checkpoint::newest_intact`]); without one, in a launcher's restarted attempt,
    /// the newest intact one in `checkpoint_dir` saved so far, if any. Checkpoints passed over
    /// as damaged are named on stderr, once per process.
    pub fn resume_target(
        checkpoint: Option<&str>,
        checkpoint_dir: &Path,
    ) -> Result<Option<PathBuf>> {
        let intact = match checkpoint {
            Some("latest") => crate::engine::checkpoint::newest_intact(checkpoint_dir)?
                .ok_or_else(|| {
                    Error::State(format!(
                        "no checkpoint at `{}`: it holds neither a manifest.json nor a latest file",
                        checkpoint_dir.display()
                    ))
                })?,
            Some(p) => return crate::engine::checkpoint::resolve(Path::new(p)).map(Some),
            None if crate::distributed::Env::from_env().restart > 0 => {
                match crate::engine::checkpoint::newest_intact(checkpoint_dir)? {
                    Some(i) => i,
                    None => return Ok(None),
                }
            }
            None => return Ok(None),
        };
        report_skipped(&intact);
        Ok(Some(intact.dir))
    }

    /// Sets the rank's step engine ([`Varuna`]). When the run goes on from a checkpoint
    /// ([`Context::resume_from`]), loads it into the engine and restores the items it saved
    /// (those registered so far now, the others as they are registered). Returns the step
    /// training goes on from (0 for a new run).
    pub fn set_engine(&mut self, mut engine: Varuna) -> Result<u64> {
        let mut step = 0;
        if let Some(path) = self.resume_from()? {
            let state = engine.load_checkpoint(&path)?;
            let items = state.extra["context"]
                .as_object()
                .cloned()
                .unwrap_or_default();
            self.load_state_dict(&Value::Object(items))?;
            step = state.step;
        }
        self.engine = Some(engine);
        Ok(step)
    }

    /// The rank's step engine ([`Context::set_engine`]).
    pub fn engine(&mut self) -> Result<&mut Varuna> {
        self.engine
            .as_mut()
            .ok_or_else(|| invalid!("no step engine: call set_engine first"))
    }

    /// Every item's state.
    pub fn state_dict(&self) -> Result<Value> {
        let mut m = serde_json::Map::new();
        for (name, item) in &self.items {
            m.insert(name.clone(), item.state_dict()?);
        }
        Ok(Value::Object(m))
    }

    /// Restores the items of `state`; those not registered yet are restored when they are.
    pub fn load_state_dict(&mut self, state: &Value) -> Result<()> {
        let map = state
            .as_object()
            .ok_or_else(|| invalid!("a context state is an object of items, not {state}"))?;
        for (name, s) in map {
            match self.items.get_mut(name) {
                Some(item) => item.load_state_dict(s)?,
                None => {
                    self.pending.insert(name.clone(), s.clone());
                }
            }
        }
        Ok(())
    }

    /// Saves the step engine and every item into `<checkpoint dir>/step-N` (collective: every
    /// rank calls it at the same point) and returns its path.
    pub fn checkpoint(&mut self) -> Result<PathBuf> {
        let opts = self.with_items(CheckpointOptions::default())?;
        let root = self.checkpoint_dir.clone();
        self.engine()?.checkpoint(&root, &opts)
    }

    /// [`Context::checkpoint`] with `opts` (how many to keep, what rebuilds the model); with
    /// `background`, its files are written by a thread while training goes on (the engine's
    /// next checkpoint, `finish_checkpoint` or load completes it).
    pub fn save(&mut self, opts: CheckpointOptions, background: bool) -> Result<()> {
        let opts = self.with_items(opts)?;
        let root = self.checkpoint_dir.clone();
        let engine = self.engine()?;
        if background {
            engine.checkpoint_async(&root, &opts)
        } else {
            engine.checkpoint(&root, &opts).map(|_| ())
        }
    }

    /// `opts` with every item's state in its `extra` as `context`.
    fn with_items(&self, mut opts: CheckpointOptions) -> Result<CheckpointOptions> {
        if !opts.extra.is_object() {
            opts.extra = json!({});
        }
        opts.extra["context"] = self.state_dict()?;
        Ok(opts)
    }

    /// Appends `line` to this rank's log, `<run dir>/rank-<rank>.log`; the master also prints
    /// it.
    pub fn log(&self, line: &str) -> Result<()> {
        use std::io::Write;
        let path = self.dir.join(format!("rank-{}.log", self.comm.rank()));
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| crate::Error::io("cannot open", &path, e))?;
        writeln!(f, "{line}").map_err(|e| crate::Error::io("cannot write", &path, e))?;
        if self.is_master() {
            crate::say!("{line}");
        }
        Ok(())
    }

    /// Whether the run has more than one rank.
    pub fn is_distributed(&self) -> bool {
        self.comm.size() > 1
    }

    /// Whether this is rank 0 (the one that writes files).
    pub fn is_master(&self) -> bool {
        self.comm.rank() == 0
    }

    /// This rank.
    pub fn get_rank(&self) -> usize {
        self.comm.rank()
    }

    /// Ranks of the run.
    pub fn get_num_processes(&self) -> usize {
        self.comm.size()
    }

    /// Rank 0's `t` on every rank.
    pub fn broadcast_from_master(&self, t: &Tensor) -> Result<Tensor> {
        self.comm.broadcast(t, 0)
    }

    /// Waits until every rank gets here.
    pub fn distributed_barrier(&self) -> Result<()> {
        self.comm.barrier()
    }
}

/// Names on stderr the checkpoints passed over to reach `intact`, once per process (every rank
/// thread resolves the same target) and from the first rank only.
fn report_skipped(intact: &crate::engine::checkpoint::Intact) {
    static SAID: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());
    if intact.skipped.is_empty() || crate::distributed::Env::from_env().rank != 0 {
        return;
    }
    let mut said = SAID.lock().unwrap_or_else(|e| e.into_inner());
    if said.contains(&intact.dir) {
        return;
    }
    said.push(intact.dir.clone());
    for s in &intact.skipped {
        eprintln!("pipewright: resuming: {s}");
    }
    eprintln!("pipewright: resuming from `{}`", intact.dir.display());
}

/// `p` with symlinks and `..` resolved (it exists).
fn canonical(p: &Path) -> Result<PathBuf> {
    p.canonicalize()
        .map_err(|e| Error::io("cannot resolve", p, e))
}
