//! The model the flags of `pipewright train` describe (the check that no flag of another
//! model or task is given is `checks.rs`).

use crate::{CnnConfig, GptConfig, LlamaConfig, ModelConfig, RunSpec, Task, TaskShape, TaskSpec};
use pipewright::ModelSpec;
use pipewright::{invalid, Result};

use super::args::{defaults, ModelKind, TrainArgs};
use super::checks::check_flags_apply;

impl TrainArgs {
    /// The run the flags describe, checked, and its task (built to learn its shape).
    pub fn spec(&self) -> Result<(RunSpec, Box<dyn Task>)> {
        let (model, task, built) = self.model_and_task()?;
        let train = self.train_spec()?;
        Ok((RunSpec { model, task, train }, built))
    }

    /// The model the flags describe, the task's spec and the task itself (`profile` and
    /// `plan` need no more).
    pub fn model_and_task(&self) -> Result<(ModelConfig, TaskSpec, Box<dyn Task>)> {
        check_flags_apply(self)?;
        let task = super::spec::task_spec(self)?;
        let built = task.build(self.seed)?;
        let model = match &self.sizes.init_from {
            Some(dir) => pretrained(self, dir, built.as_ref())?,
            None => make_model(self, built.as_ref())?,
        };
        Ok((model, task, built))
    }
}

/// The model of the Hugging Face directory `dir` (`--init-from`), checked against the flags
/// (no size flag: the directory gives the sizes; `--block-size` sets the training windows,
/// at most the model's positions) and the task (its ids and sequences fit).
fn pretrained(a: &TrainArgs, dir: &std::path::Path, task: &dyn Task) -> Result<ModelConfig> {
    let d = defaults();
    let sizes = [
        ("--n-layer", a.sizes.n_layer != d.sizes.n_layer),
        ("--n-head", a.sizes.n_head != d.sizes.n_head),
        ("--n-embd", a.sizes.n_embd != d.sizes.n_embd),
        ("--vocab-size", a.sizes.vocab_size.is_some()),
        ("--n-kv-head", a.sizes.n_kv_head.is_some()),
        ("--mlp-hidden", a.sizes.mlp_hidden.is_some()),
        // The rotary base is the weights' as much as a size is: they were trained with it.
        ("--rope-theta", a.sizes.rope_theta != d.sizes.rope_theta),
    ];
    let given: Vec<&str> = sizes.iter().filter(|(_, g)| *g).map(|(f, _)| *f).collect();
    if !given.is_empty() {
        return Err(invalid!(
            "--init-from takes the model's sizes from `{}`: drop {}",
            dir.join("config.json").display(),
            given.join(", ")
        ));
    }
    let mut model = crate::hf::config_from_dir(dir)?;
    // Dropout is the fine-tuning's to choose, not the weights': a given --dropout replaces
    // the directory's (it was recorded and then ignored).
    if let ModelConfig::Gpt { gpt, .. } = &mut model {
        if a.sizes.dropout != d.sizes.dropout {
            gpt.dropout = a.sizes.dropout;
        }
    }
    check_layers(dir, &model)?;
    let (kind, vocab_size, block) = match &model {
        ModelConfig::Gpt { gpt, .. } => (ModelKind::Gpt, gpt.vocab_size, gpt.block_size),
        ModelConfig::Llama { llama, .. } => (ModelKind::Llama, llama.vocab_size, llama.block_size),
        ModelConfig::Cnn { .. } => {
            return Err(invalid!("`{}` holds no language model", dir.display()))
        }
    };
    if std::mem::discriminant(&kind) != std::mem::discriminant(&a.model) {
        return Err(invalid!(
            "`{}` holds a {:?}: pass --model {}",
            dir.display(),
            kind,
            format!("{kind:?}").to_lowercase()
        ));
    }
    let TaskShape::Tokens { vocab, seq_len } = task.shape() else {
        return Err(invalid!(
            "a pretrained language model needs a token task, not {}",
            task.name()
        ));
    };
    if vocab > vocab_size || seq_len > block {
        return Err(invalid!(
            "the task's {vocab} token ids and sequences of {seq_len} do not fit the pretrained \
             model's vocabulary of {vocab_size} and {block} positions"
        ));
    }
    if let Some(n) = model
        .tp_divides()
        .into_iter()
        .find(|n| n % a.parallel.layout.tp != 0)
    {
        return Err(invalid!(
            "the pretrained model's {n} (heads or vocabulary) cannot be split over --tp {}",
            a.parallel.layout.tp
        ));
    }
    super::moe::check_pretrained(a, dir, &model)?;
    Ok(model)
}

/// Fails unless the weights of `dir` hold as many blocks as its `config.json` says `model`
/// has: with fewer layers in the config, the blocks past them would be left unread and a
/// truncated model trained unsaid (fewer in the weights fail when a block is read).
fn check_layers(dir: &std::path::Path, model: &ModelConfig) -> Result<()> {
    let n_layer = match model {
        ModelConfig::Gpt { gpt, .. } => gpt.n_layer,
        ModelConfig::Llama { llama, .. } => llama.n_layer,
        ModelConfig::Cnn { .. } => return Ok(()),
    };
    // `transformer.h.N.` (GPT-2) or `model.layers.N.` (the Llama's family).
    let block = |name: &str| -> Option<usize> {
        let mut parts = name.split('.');
        while let Some(p) = parts.next() {
            if p == "h" || p == "layers" {
                return parts.next()?.parse().ok();
            }
        }
        None
    };
    let weights = pipewright::engine::checkpoint::HfWeights::open(dir)?;
    let held = weights
        .shapes()
        .keys()
        .filter_map(|n| block(n))
        .max()
        .map_or(0, |m| m + 1);
    if held > n_layer {
        return Err(invalid!(
            "`{}` holds weights of {held} blocks but its config.json says {n_layer}: the blocks \
             past {n_layer} would be left out. Fix num_hidden_layers (n_layer) in config.json, \
             or drop the extra blocks' tensors to train a truncated model on purpose",
            dir.display()
        ));
    }
    Ok(())
}

/// The model the flags describe, for `task`.
fn make_model(a: &TrainArgs, task: &dyn Task) -> Result<ModelConfig> {
    match (a.model, task.shape()) {
        (kind @ (ModelKind::Gpt | ModelKind::Llama), TaskShape::Tokens { vocab, seq_len }) => {
            language_model(a, kind, vocab, seq_len)
        }
        (
            ModelKind::Cnn,
            TaskShape::Images {
                channels, classes, ..
            },
        ) => {
            if a.parallel.layout.tp > 1 {
                return Err(invalid!(
                    "--tp splits the GPT's and the Llama's layers; the CNN has no tensor-parallel \
                     layers: use --tp 1"
                ));
            }
            if a.parallel.layout.cp > 1 {
                return Err(invalid!(
                    "--cp splits sequences; the CNN reads images: use --cp 1"
                ));
            }
            let cfg = CnnConfig {
                width: a.sizes.width,
                blocks: a.sizes.blocks,
                long_skip: a.sizes.long_skip,
                ..CnnConfig::small(channels, classes)
            };
            Ok(ModelConfig::Cnn { cnn: cfg })
        }
        (ModelKind::Gpt | ModelKind::Llama, _) => Err(invalid!(
            "--model {} needs a token task (adder, sort, text, tokens), not {}",
            format!("{:?}", a.model).to_lowercase(),
            task.name()
        )),
        (ModelKind::Cnn, _) => Err(invalid!(
            "--model cnn needs an image task (shapes), not {}",
            task.name()
        )),
    }
}

/// The GPT or the Llama (`kind`) the flags describe for a task of `vocab` ids in sequences
/// of `seq_len`, its sizes checked against the layout (heads, vocabulary and the MLP over tp,
/// sequences over cp and sequence parallelism).
fn language_model(
    a: &TrainArgs,
    kind: ModelKind,
    vocab: usize,
    seq_len: usize,
) -> Result<ModelConfig> {
    let block_size = a.sizes.block_size.unwrap_or(seq_len);
    if block_size < seq_len {
        return Err(invalid!(
            "--block-size {block_size} is shorter than the task's sequences of {seq_len} tokens"
        ));
    }
    let vocab_size = a.sizes.vocab_size.unwrap_or(vocab);
    if vocab_size < vocab {
        return Err(invalid!(
            "--vocab-size {vocab_size} is smaller than the task's vocabulary of {vocab}"
        ));
    }
    if !vocab_size.is_multiple_of(a.parallel.layout.tp) {
        let padded = vocab_size.div_ceil(a.parallel.layout.tp) * a.parallel.layout.tp;
        return Err(invalid!(
            "a vocabulary of {vocab_size} cannot be split over --tp {}: pass --vocab-size {padded} \
             (padded ids never occur)",
            a.parallel.layout.tp
        ));
    }
    if !a.sizes.n_head.is_multiple_of(a.parallel.layout.tp) {
        return Err(invalid!(
            "--n-head {} cannot be split over --tp {}: choose a multiple of --tp",
            a.sizes.n_head,
            a.parallel.layout.tp
        ));
    }
    check_sequence_split(a, seq_len)?;
    if let ModelKind::Llama = kind {
        let family = LlamaConfig::new(
            vocab_size,
            block_size,
            a.sizes.n_layer,
            a.sizes.n_head,
            a.sizes.n_embd,
        );
        let n_kv_head = a.sizes.n_kv_head.unwrap_or(family.n_kv_head);
        let hidden = a.sizes.mlp_hidden.unwrap_or(family.hidden);
        for (flag, n) in [("--n-kv-head", n_kv_head), ("--mlp-hidden", hidden)] {
            if !n.is_multiple_of(a.parallel.layout.tp) {
                return Err(invalid!(
                    "{flag} {n} cannot be split over --tp {}: choose a multiple of --tp",
                    a.parallel.layout.tp
                ));
            }
        }
        let llama = LlamaConfig {
            n_kv_head,
            hidden,
            rope_theta: a.sizes.rope_theta,
            moe: super::moe::mixture(a, hidden),
            ..family
        };
        llama.validate()?;
        return Ok(ModelConfig::Llama { llama, vocab });
    }
    let cfg = GptConfig {
        n_layer: a.sizes.n_layer,
        n_head: a.sizes.n_head,
        n_embd: a.sizes.n_embd,
        dropout: a.sizes.dropout,
        ..GptConfig::small(vocab_size, block_size)
    };
    Ok(ModelConfig::Gpt { gpt: cfg, vocab })
}

/// Fails early, naming the flags, when `--cp` or `--sequence-parallel` cannot split sequences
/// of `seq_len` tokens (the library would fail at the first step).
fn check_sequence_split(a: &TrainArgs, seq_len: usize) -> Result<()> {
    let n = 2 * a.parallel.layout.cp;
    if a.parallel.layout.cp > 1 && !seq_len.is_multiple_of(n) {
        return Err(invalid!(
            "--cp {} splits each sequence into 2 x cp = {n} chunks, but the task's sequences have \
             {seq_len} tokens: choose a sequence length that is a multiple of {n}, or a --cp whose \
             2 x cp divides {seq_len}",
            a.parallel.layout.cp
        ));
    }
    if a.parallel.layout.cp > 1 && a.sizes.dropout > 0.0 {
        return Err(invalid!(
            "--cp runs attention over a ring without dropout: pass --dropout 0 with --cp {}",
            a.parallel.layout.cp
        ));
    }
    if a.parallel.sequence_parallel
        && a.parallel.layout.tp > 1
        && !(seq_len / a.parallel.layout.cp).is_multiple_of(a.parallel.layout.tp)
    {
        return Err(invalid!(
            "--sequence-parallel splits each rank's {} tokens over --tp {}: choose a sequence \
             length that is a multiple of {}",
            seq_len / a.parallel.layout.cp,
            a.parallel.layout.tp,
            a.layout()?.sequence_multiple(true)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name)
    }

    /// With --init-from a model trains on windows of its own positions (the hf-llama
    /// fixture's 16), not the default 64 that made a pretrained Llama's held-out perplexity
    /// 25 % worse than PyTorch's (issue 61); --block-size sets shorter ones, not longer.
    #[test]
    fn a_pretrained_model_trains_on_windows_of_its_positions() {
        let mut a = defaults();
        a.model = ModelKind::Llama;
        a.task = super::super::args::TaskKind::Text;
        a.inputs.data =
            Some(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../README.md"));
        a.sizes.init_from = Some(fixture("hf-llama"));
        a.sizes.vocab_size = None;
        let seq = |a: &TrainArgs| match super::super::spec::task_spec(a).unwrap() {
            TaskSpec::Text { seq_len, .. } => seq_len,
            other => panic!("{other:?}"),
        };
        assert_eq!(seq(&a), 16);
        a.sizes.block_size = Some(8);
        assert_eq!(seq(&a), 8);
        a.sizes.block_size = Some(17);
        let e = a
            .model_and_task()
            .err()
            .expect("17 tokens do not fit 16 positions");
        assert!(e.to_string().contains("16 positions"), "{e}");
    }

    /// A run that names no size gets each model's own small config, for the task's
    /// vocabulary and sequences; the Llama's MLP is SwiGLU's 8/3 of its width rounded up to
    /// 8 (128 wide: 341.3 -> 344) and its key/value heads are its heads.
    #[test]
    fn the_flags_defaults_are_the_models_own() {
        let mut a = defaults();
        for kind in [ModelKind::Gpt, ModelKind::Llama] {
            a.model = kind;
            let (model, _, task) = a.model_and_task().unwrap();
            let TaskShape::Tokens { vocab, seq_len } = task.shape() else {
                panic!("the default task reads tokens")
            };
            match model {
                ModelConfig::Gpt { gpt, .. } => assert_eq!(gpt, GptConfig::small(vocab, seq_len)),
                ModelConfig::Llama { llama, .. } => {
                    assert_eq!(llama, LlamaConfig::small(vocab, seq_len));
                    assert_eq!((llama.hidden, llama.n_kv_head), (344, 4));
                }
                other => panic!("{other:?}"),
            }
        }
        a.model = ModelKind::Cnn;
        a.task = super::super::args::TaskKind::Shapes;
        let (model, _, task) = a.model_and_task().unwrap();
        let TaskShape::Images {
            channels, classes, ..
        } = task.shape()
        else {
            panic!("the shapes task reads images")
        };
        let ModelConfig::Cnn { cnn } = model else {
            panic!("{model:?}")
        };
        assert_eq!(cnn, CnnConfig::small(channels, classes));
    }
}
