//! A run of a reference model as data: the model's configuration, the task it learns and the
//! library's [`TrainSpec`]. `pipewright train` turns its flags into a [`RunSpec`], records it in
//! `params.json` and in every checkpoint (`ckpt reshard` and `ckpt export` rebuild the model
//! from it), and morphs it when a restarted run finds a world of another size.

use std::path::PathBuf;

use pipewright::engine::varuna::Sampling;
use pipewright::experiment::report::Prediction;
use pipewright::model::precision::Precision;
use pipewright::plan::{
    estimate, Candidate, Cluster, Hardware, ModelShapes, Morph, Profile, Runtime,
};
use pipewright::trainer::model_spec::ModelSpec;
use pipewright::trainer::TrainSpec;
use pipewright::{invalid, Error, Result, Sequential};
use serde::{Deserialize, Serialize};

use crate::tasks::{Adder, Shapes, Sort, Text, Tokens};
use crate::{CnnConfig, GptConfig, LlamaConfig, Task, TaskShape};

/// A model by its configuration: what a checkpoint stores to rebuild it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelConfig {
    /// The GPT, and the task's vocabulary (the GPT's may be padded beyond it).
    Gpt {
        /// The GPT's sizes.
        gpt: GptConfig,
        /// Token ids the data uses (at most `gpt.vocab_size`).
        vocab: usize,
    },
    /// The Llama, and the task's vocabulary (the Llama's may be padded beyond it).
    Llama {
        /// The Llama's sizes.
        llama: LlamaConfig,
        /// Token ids the data uses (at most `llama.vocab_size`).
        vocab: usize,
    },
    /// The CNN.
    Cnn {
        /// The CNN's sizes.
        cnn: CnnConfig,
    },
}

impl ModelConfig {
    /// The model's own description.
    fn spec(&self) -> &dyn ModelSpec {
        match self {
            ModelConfig::Gpt { gpt, .. } => gpt,
            ModelConfig::Llama { llama, .. } => llama,
            ModelConfig::Cnn { cnn } => cnn,
        }
    }

    /// Greedy decoding of `max_new_tokens` tokens within the model's window and the data's
    /// vocabulary (`Sampling::greedy`; set the other fields for sampling); an error for the
    /// CNN, which makes no text.
    pub fn sampling(&self, max_new_tokens: usize) -> Result<Sampling> {
        let (block, vocab, rotary) = match self {
            ModelConfig::Gpt { gpt, vocab } => (gpt.block_size, *vocab, false),
            ModelConfig::Llama { llama, vocab } => (llama.block_size, *vocab, true),
            ModelConfig::Cnn { .. } => return Err(invalid!("the CNN does not generate text")),
        };
        Ok(Sampling {
            extends: rotary,
            ..Sampling::greedy(max_new_tokens, block, vocab)
        })
    }
}

impl ModelSpec for ModelConfig {
    fn what(&self) -> String {
        self.spec().what()
    }

    fn build(&self) -> Result<Sequential> {
        self.spec().build()
    }

    fn tied(&self) -> Vec<(String, String)> {
        self.spec().tied()
    }

    fn tp_divides(&self) -> Vec<usize> {
        self.spec().tp_divides()
    }

    fn shapes(&self, sample: &[usize]) -> Result<Option<ModelShapes>> {
        self.spec().shapes(sample)
    }

    fn hf_names(&self, name: &str) -> Vec<String> {
        self.spec().hf_names(name)
    }
}

/// The data a run learns from: a generated task, or a text file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskSpec {
    /// Sums of two `digits`-digit numbers ([`Adder`]).
    Adder {
        /// Digits of each operand.
        digits: usize,
    },
    /// Sequences of `len` symbols out of `symbols` to sort ([`Sort`]).
    Sort {
        /// Symbols per sequence.
        len: usize,
        /// Distinct symbols.
        symbols: u32,
    },
    /// Images of shapes to classify ([`Shapes`]).
    Shapes {
        /// Side of the images in pixels.
        image_size: usize,
    },
    /// Token shards of a prepared corpus in windows of `seq_len` ids ([`Tokens`]).
    Tokens {
        /// The shard directory (`pipewright data prepare`).
        dir: PathBuf,
        /// Ids per window.
        seq_len: usize,
        /// SHA-256 of the tokenizer that encoded the shards (their index's), recorded so that
        /// a resumed run or a generation never reads ids with another tokenizer; empty in
        /// specs saved before it was recorded.
        #[serde(default)]
        tokenizer_sha256: String,
        /// A blend (`--data 0.7:A,0.3:B`): every dataset with its weight, `dir` the first;
        /// empty for `dir` alone.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        blend: Vec<(f64, PathBuf)>,
    },
    /// A text file's bytes in windows of `seq_len` ([`Text`]).
    Text {
        /// The file.
        path: PathBuf,
        /// Bytes per sequence.
        seq_len: usize,
    },
}

impl TaskSpec {
    /// The task, its random draws seeded by `seed`.
    pub fn build(&self, seed: u64) -> Result<Box<dyn Task>> {
        Ok(match self {
            TaskSpec::Adder { digits } => Box::new(Adder::new(*digits, seed)?),
            TaskSpec::Sort { len, symbols } => Box::new(Sort::new(*len, *symbols, seed)?),
            TaskSpec::Shapes { image_size } => Box::new(Shapes::new(*image_size, seed)?),
            TaskSpec::Text { path, seq_len } => Box::new(Text::from_file(path, *seq_len, seed)?),
            TaskSpec::Tokens {
                dir,
                seq_len,
                tokenizer_sha256,
                blend,
            } => {
                let parts = match blend.is_empty() {
                    true => vec![(1.0, dir.clone())],
                    false => blend.clone(),
                };
                let t = Tokens::open(&parts, *seq_len, seed)?;
                let found = &t.dataset().index().tokenizer_sha256;
                if !tokenizer_sha256.is_empty() && found != tokenizer_sha256 {
                    return Err(invalid!(
                        "the shards in `{}` were encoded by another tokenizer (sha256 {}) than \
                         this run's (sha256 {}): train on the shards of the run's tokenizer",
                        dir.display(),
                        &found[..found.len().min(12)],
                        &tokenizer_sha256[..tokenizer_sha256.len().min(12)]
                    ));
                }
                Box::new(t)
            }
        })
    }
}

/// A reference model, its task and how it trains.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunSpec {
    /// The model.
    pub model: ModelConfig,
    /// The data.
    pub task: TaskSpec,
    /// Layout, batch, schedule, precision, optimizer, learning rate, seed and cadence.
    #[serde(flatten)]
    pub train: TrainSpec,
}

/// The key of a checkpoint's meta (`CheckpointOptions::meta`) that holds the run's spec.
pub const META_KEY: &str = "spec";

impl RunSpec {
    /// The task, seeded by the run's seed.
    pub fn build_task(&self) -> Result<Box<dyn Task>> {
        self.task.build(self.train.seed)
    }

    /// The dims of one input sample the model is sized for: `[channels, size, size]` for the
    /// CNN's images, the window `[block_size]` for a language model.
    pub fn sample(&self) -> Result<Vec<usize>> {
        Ok(match (&self.model, &self.task) {
            (ModelConfig::Cnn { cnn }, TaskSpec::Shapes { image_size }) => {
                vec![cnn.in_channels, *image_size, *image_size]
            }
            (ModelConfig::Cnn { .. }, t) => {
                return Err(invalid!("the CNN learns images, not {t:?}"))
            }
            (ModelConfig::Gpt { gpt, .. }, _) => vec![gpt.block_size],
            (ModelConfig::Llama { llama, .. }, _) => vec![llama.block_size],
        })
    }

    /// The planner's profile of this run's model from its shapes on `hw`.
    pub fn shapes_profile(&self, hw: &Hardware) -> Result<Profile> {
        self.model
            .shapes_profile(&self.sample()?, self.train.precision, hw)?
            .ok_or_else(|| invalid!("{} has no shapes to plan from", self.model.what()))
    }

    /// This run restarted in a world of `world` ranks (see [`TrainSpec::morph`]). With
    /// `machines` (the hardware and its ranks per node) the model is planned from its shapes
    /// and the fastest layout that fits taken; without, the layout nearest the old one.
    pub fn morph(
        &self,
        world: usize,
        machines: Option<(&Hardware, usize)>,
    ) -> Result<(RunSpec, Morph)> {
        let (train, m) = self
            .train
            .morph_model(world, &self.model, &self.sample()?, machines)?;
        Ok((
            RunSpec {
                train,
                ..self.clone()
            },
            m,
        ))
    }

    /// The planner's prediction for this run's own layout on `hw` (`ranks_per_node` ranks a
    /// node), from the model's shapes, its sums costed overlapped when the run overlaps them
    /// over a `backend` that moves them in the background (see [`Runtime::pipewright`]): what
    /// a run's report draws beside what it measured.
    pub fn predict(
        &self,
        hw: &Hardware,
        ranks_per_node: usize,
        backend: pipewright::distributed::comm::Backend,
    ) -> Result<Prediction> {
        let profile = self.shapes_profile(hw)?;
        let t = &self.train;
        let world = t.world();
        let cluster = Cluster {
            hardware: hw,
            ranks_per_node: ranks_per_node.clamp(1, world.max(1)),
            runtime: Runtime::pipewright(
                t.overlap.overlap,
                backend.progresses_in_background(),
                t.overlap.bucket_bytes,
            ),
        };
        let cand = Candidate {
            parallel: t.parallel,
            micro_batch: t.batch.micro_batch,
            micro_batches: t.micro_batches()?,
            schedule: t.pipeline.schedule,
        };
        let (e, sim) = estimate(&profile, &cluster, &cand)?;
        let half = self.train.precision != Precision::F32;
        Ok(Prediction::new(hw, hw.peak_flops(half), &e, &sim))
    }

    /// What [`RunSpec::check_fits`] sizes, per sample of `shape`: the model's name, its
    /// parameters, the activation bytes one sample keeps (from the model's shapes, as the
    /// planner sizes them), and its input's bytes.
    fn sizes(&self, shape: &TaskShape) -> Result<(String, f64, f64, f64)> {
        let input = match *shape {
            TaskShape::Tokens { seq_len, .. } => seq_len as f64 * 8.0,
            TaskShape::Images { channels, size, .. } => {
                size as f64 * size as f64 * channels as f64 * 4.0
            }
        };
        let shapes = self
            .model
            .shapes(&self.sample()?)?
            .ok_or_else(|| invalid!("{} has no shapes to size", self.model.what()))?;
        let kept = shapes.kept_bytes_per_sample(self.train.precision.dtype().size_in_bytes());
        Ok((shapes.what.clone(), shapes.params(), kept, input))
    }

    /// The run's balance when it is layers per model stage (given, or measured by the
    /// trainer), said in layers as summary.json records it, the segments between cut points
    /// beside where the model has them; `None` for a uniform split.
    pub fn describe_balance(&self) -> Result<Option<String>> {
        let Some(pipewright::parallel::pipeline::Balance::Layers(b)) = &self.train.pipeline.balance
        else {
            return Ok(None);
        };
        let model = pipewright::trainer::model_spec::ModelSpec::build(&self.model)?;
        pipewright::parallel::pipeline::partition::describe_balance(&model, b).map(Some)
    }

    /// The most held-out rows an evaluation forward may take at once: those whose activations
    /// (what a training sample keeps, an upper bound on a forward's) fit in a quarter of the
    /// memory available, 1 GiB at most, and at least a micro-batch (which training holds).
    pub fn eval_rows(&self, shape: &TaskShape) -> Result<usize> {
        let (_, _, kept, _) = self.sizes(shape)?;
        let budget = pipewright::runtime::memory::available_bytes()
            .map_or(1u64 << 30, |a| (a / 4).min(1 << 30)) as f64;
        let rows = (budget / kept.max(1.0)).min(usize::MAX as f64) as usize;
        Ok(rows.max(self.train.batch.micro_batch))
    }

    /// Fails, before the model is built or a batch made, when training would need more memory
    /// than this machine has available, for `ranks_here` of the run's ranks in this process
    /// (all of them as threads; the local ones under mpirun), on data of `shape`. Per replica:
    /// the parameters with gradients and AdamW's moments (16 bytes each in f32), the
    /// activations its micro-batches in flight keep (from the model's shapes, as the planner
    /// sizes them), and the global batch itself.
    pub fn check_fits(&self, shape: &TaskShape, ranks_here: usize) -> Result<()> {
        let t = &self.train;
        let (what, params, kept, input) = self.sizes(shape)?;
        let micro_batches = t.micro_batches()?;
        let in_flight = micro_batches.min(t.parallel.layout.pp).max(1) as f64;
        let replica = params * 16.0 + kept * (t.batch.micro_batch as f64) * in_flight;
        let here = ranks_here.clamp(1, t.world());
        let share = here as f64 / t.world() as f64;
        pipewright::runtime::memory::check_fits(
            replica * t.parallel.layout.dp as f64 * share + input * t.batch.global_batch as f64,
            &format!(
                "training {what} on batches of {} rows in micro-batches of {} on {here} of its \
                 ranks",
                t.batch.global_batch, t.batch.micro_batch,
            ),
            "make the model smaller, the batch or micro-batch smaller (--batch-size, --chunks, \
             --chunk-size), or spread the ranks over more machines",
        )
    }

    /// The spec a checkpoint's meta holds under [`META_KEY`]; an error that says so when the
    /// checkpoint was not saved by a [`RunSpec`] run.
    pub fn from_meta(meta: &serde_json::Value) -> Result<RunSpec> {
        serde_json::from_value(meta[META_KEY].clone()).map_err(|e| {
            Error::State(format!(
                "the checkpoint's meta has no run spec under `{META_KEY}` ({e}): it was not saved \
                 by `pipewright train`"
            ))
        })
    }

    /// The meta to save with every checkpoint of this run (see [`RunSpec::from_meta`]).
    pub fn to_meta(&self) -> Result<serde_json::Value> {
        let spec =
            serde_json::to_value(self).map_err(|e| invalid!("cannot record the run: {e}"))?;
        Ok(serde_json::json!({ META_KEY: spec }))
    }
}
