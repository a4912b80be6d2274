//! Varuna's `checkpoint` / `load_checkpoint`: save from any layout, resume into any other (see
//! [`crate::engine::checkpoint`] for the format).

use std::path::{Path, PathBuf};

use candle_core::Var;
use serde::{Deserialize, Serialize};

use super::Varuna;
use crate::engine::checkpoint::{self, CheckpointOptions, Header, Owned, Reader};
use crate::model::nn::optim::{LrSchedule, StateDict};
use crate::model::precision::LossScaler;
use crate::{invalid, Error, Result};

/// `state.json` of a Varuna checkpoint.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainState {
    /// Steps taken (skipped overflow steps included): the next step's number, which keys
    /// dropout masks and the data order.
    pub step: u64,
    /// Optimizer steps taken (skipped steps excluded).
    pub optimizer_step: u64,
    /// The learning-rate schedule it trained with.
    pub lr_schedule: LrSchedule,
    /// The loss scaler's state (f16 only).
    pub loss_scaler: Option<LossScaler>,
    /// The run's seed.
    pub seed: u64,
    /// What the caller added ([`CheckpointOptions::extra`]).
    #[serde(default)]
    pub extra: serde_json::Value,
}

impl Varuna {
    /// What this rank holds of `params` (its whole f32 parameters, see
    /// [`Varuna::whole_masters`]) as the checkpoint sees it.
    fn owned<'a>(&'a self, params: &'a [(String, Var)]) -> Owned<'a> {
        let c = self.coords;
        // The first expert group holds every expert between its ranks.
        let first_group = c.dp_rank < self.topo.layout().ep && c.cp_rank == 0;
        Owned {
            rank: self.world.rank(),
            params,
            shards: self.pipeline.shards(),
            buffers: self.pipeline.buffers(),
            write_whole: c.dp_rank == 0 && c.cp_rank == 0 && c.tp_rank == 0,
            write_shards: c.dp_rank == 0 && c.cp_rank == 0,
            experts: self.pipeline.experts().to_vec(),
            write_experts: first_group && c.tp_rank == 0,
            write_expert_shards: first_group,
        }
    }

    /// The optimizer's state over whole parameters (collective over the replicas under ZeRO,
    /// whose pieces are gathered).
    fn whole_optimizer_state(&self) -> Result<StateDict> {
        let optimizer = self
            .optimizer
            .as_ref()
            .ok_or_else(|| invalid!("no optimizer: call set_optimizer before checkpoint"))?;
        let state = optimizer.state_dict()?;
        match self.weights.sharded() {
            Some(z) => z.whole_state(self.replicas(), &state),
            None => Ok(state),
        }
    }

    /// A snapshot of everything this rank writes (collective under ZeRO).
    fn snapshot(&self) -> Result<checkpoint::Snapshot> {
        let whole = self.whole_masters(false)?;
        let state = self.whole_optimizer_state()?;
        self.owned(&whole).snapshot(&state)
    }

    fn header(&self, opts: &CheckpointOptions) -> Result<Header> {
        let optimizer = self
            .optimizer
            .as_ref()
            .ok_or_else(|| invalid!("no optimizer: call set_optimizer before checkpoint"))?;
        let optimizer_step = optimizer
            .state_dict()?
            .get("step")
            .map(|t| t.flatten_all()?.to_vec1::<i64>())
            .transpose()?
            .and_then(|v| v.first().copied())
            .unwrap_or(0) as u64;
        let state = TrainState {
            step: self.pipeline.steps_taken(),
            optimizer_step,
            lr_schedule: self.opts.spec.optim.lr,
            loss_scaler: self.scaler.clone(),
            seed: self.opts.spec.seed,
            extra: opts.extra.clone(),
        };
        Ok(Header {
            layout: self.topo.layout(),
            precision: self.opts.spec.precision.to_string(),
            world: self.world.size(),
            step: state.step,
            state: serde_json::to_value(&state).map_err(|e| invalid!("checkpoint: {e}"))?,
            meta: opts.meta.clone(),
            keep: opts.keep,
        })
    }

    /// Saves this job's state into `<root>/step-NNNNNNNN` (collective over the world): the
    /// f32 parameters, the optimizer state, buffers, the step and the loss scaler. Waits for a
    /// background save first. Returns the checkpoint's directory.
    pub fn checkpoint(&mut self, root: &Path, opts: &CheckpointOptions) -> Result<PathBuf> {
        self.finish_checkpoint()?;
        let header = self.header(opts)?;
        let snap = self.snapshot()?;
        checkpoint::save_now(Some(self.world.as_ref()), root, header, snap)
    }

    /// [`Varuna::checkpoint`] with the files written by a background thread: the state is
    /// copied off the training tensors now, training goes on, and the next checkpoint,
    /// [`Varuna::finish_checkpoint`] or [`Varuna::load_checkpoint`] completes it (collective).
    pub fn checkpoint_async(&mut self, root: &Path, opts: &CheckpointOptions) -> Result<()> {
        self.finish_checkpoint()?;
        let header = self.header(opts)?;
        let snap = self.snapshot()?;
        self.pending = Some(checkpoint::start(
            Some(self.world.as_ref()),
            root,
            header,
            snap,
        )?);
        Ok(())
    }

    /// Completes a background save, if one is under way (collective); its directory.
    pub fn finish_checkpoint(&mut self) -> Result<Option<PathBuf>> {
        match self.pending.take() {
            Some(p) => checkpoint::finish(Some(self.world.as_ref()), p).map(Some),
            None => Ok(None),
        }
    }

    /// Loads pretrained weights from the Hugging Face model directory `dir` into this rank's
    /// parameters (collective: every rank fails if one does). `names` gives the names a
    /// parameter may have there, in order of preference (a tied head absent from the file is
    /// found under its embedding's name). Each rank reads only its own part of each tensor; a
    /// missing tensor or a shape that differs is an error naming it.
    pub fn load_pretrained(
        &mut self,
        dir: &Path,
        names: &dyn Fn(&str) -> Vec<String>,
    ) -> Result<()> {
        self.finish_checkpoint()?;
        let whole = self.whole_masters(true)?;
        let owned = self.owned(&whole);
        let read = checkpoint::HfWeights::open(dir).and_then(|w| {
            let mut values = Vec::new();
            for (name, var) in owned.params {
                let (split, whole) = owned.split(name);
                let whole = whole.unwrap_or_else(|| var.dims().to_vec());
                let tried = names(name);
                let hf = tried.iter().find(|n| w.has(n)).ok_or_else(|| {
                    Error::State(format!(
                        "`{}` has no tensor for parameter `{name}` (looked for {tried:?})",
                        dir.display()
                    ))
                })?;
                let theirs = w.shape(hf).unwrap_or_default();
                if theirs != whole.as_slice() {
                    return Err(Error::State(format!(
                        "`{}`: `{hf}` is {theirs:?} but parameter `{name}` is {whole:?}: the \
                         model's sizes differ from the pretrained one's",
                        dir.display()
                    )));
                }
                let t = w.read(hf, split)?;
                values.push((
                    var.clone(),
                    t.to_dtype(var.dtype())?.to_device(var.device())?,
                ));
            }
            Ok(values)
        });
        let status = read.as_ref().map(|_| Vec::new()).map_err(as_state);
        checkpoint::agree(Some(self.world.as_ref()), status)?;
        for (var, t) in read? {
            var.set(&t)?;
        }
        self.set_whole_masters(&whole)
    }

    /// Loads the checkpoint at `path` (a `step-NNNNNNNN` directory, or a directory of them
    /// whose `latest` is taken), saved from any layout and precision, into this rank's stages
    /// and shards (collective over the world). Returns the step training goes on from.
    pub fn load_checkpoint(&mut self, path: &Path) -> Result<TrainState> {
        self.finish_checkpoint()?;
        let opened = Reader::open(path);
        let whole = self.whole_masters(true)?;
        // Every rank's parameters, so that a model mismatch is named whole on every rank.
        let mine = serde_json::to_vec(&self.owned(&whole).param_shapes())
            .map_err(|e| invalid!("checkpoint: {e}"))?;
        let all = checkpoint::agree(Some(self.world.as_ref()), Ok(mine))?;
        let mut params = Vec::new();
        for bytes in all {
            let p: Vec<(String, Vec<usize>)> =
                serde_json::from_slice(&bytes).map_err(|e| invalid!("checkpoint: {e}"))?;
            params.extend(p);
        }
        params.sort();
        params.dedup();
        let loaded = opened.and_then(|r| {
            r.check_model(&params)?;
            let state: TrainState = serde_json::from_value(r.state().clone()).map_err(|e| {
                Error::State(format!(
                    "`{}`: state.json is not a training state: {e}",
                    r.dir().display()
                ))
            })?;
            let restored = self.owned(&whole).read(&r, state.optimizer_step)?;
            let optimizer = self.optimizer.as_deref_mut().ok_or_else(|| {
                invalid!("no optimizer: call set_optimizer before load_checkpoint")
            })?;
            let sharded = self.weights.sharded();
            restored.apply(|s| match sharded {
                Some(z) => optimizer.load_state_dict(&z.cut_state(s)?),
                None => optimizer.load_state_dict(s),
            })?;
            Ok(state)
        });
        let status = loaded.as_ref().map(|_| Vec::new()).map_err(as_state);
        checkpoint::agree(Some(self.world.as_ref()), status)?;
        let state = loaded?;
        self.set_whole_masters(&whole)?;
        self.pipeline.set_steps_taken(state.step);
        if self.scaler.is_some() {
            self.scaler = state.loss_scaler.clone().or_else(|| self.scaler.clone());
        }
        Ok(state)
    }
}

/// A rank's load error as the state error every rank reports (its message once, not wrapped
/// again when it is one already).
fn as_state(e: &Error) -> Error {
    match e {
        Error::State(m) => Error::State(m.clone()),
        other => Error::State(other.to_string()),
    }
}
