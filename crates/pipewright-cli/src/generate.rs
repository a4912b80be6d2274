//! `pipewright generate`: text (or token ids) from a trained checkpoint or a Hugging Face model
//! directory, on ranks as threads in any pp x tp layout; every rank draws the same tokens.

use std::path::PathBuf;

use clap::Args;
use pipewright::data::Tokenizer;
use pipewright::distributed::comm::local;
use pipewright::distributed::topology::Layout;
use pipewright::engine::checkpoint::Reader;
use pipewright::engine::varuna::{Sampling, Varuna, VarunaOptions};
use pipewright::model::nn::optim::OptimizerConfig;
use pipewright::ModelSpec;
use pipewright::{invalid, Result};
use pipewright_models::{hf, TaskSpec};

#[derive(Args)]
pub struct GenerateArgs {
    /// A checkpoint of `pipewright train` (a step directory, or a directory of them).
    #[arg(long, conflicts_with = "init_from")]
    pub checkpoint: Option<PathBuf>,
    /// A Hugging Face model directory (GPT-2 or Llama).
    #[arg(long)]
    pub init_from: Option<PathBuf>,
    /// The `tokenizer.json` that encodes --prompt and decodes the output.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// The text to continue (with --tokenizer).
    #[arg(long, conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// The token ids to continue, comma-separated (no tokenizer needed).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Tokens to add.
    #[arg(long, default_value_t = 32, value_parser = crate::train::positive)]
    pub max_new_tokens: usize,
    /// Softmax temperature; 0 is greedy decoding.
    #[arg(long, default_value_t = 0.8, value_parser = crate::train::finite)]
    pub temperature: f64,
    /// Draw among the k most likely tokens only.
    #[arg(long, value_parser = crate::train::positive)]
    pub top_k: Option<usize>,
    /// Seeds the draws.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Pipeline stages.
    #[arg(long, default_value_t = 1, value_parser = crate::train::positive)]
    pub pp: usize,
    /// Tensor-parallel ranks.
    #[arg(long, default_value_t = 1, value_parser = crate::train::positive)]
    pub tp: usize,
    /// Expert-parallel ranks: a mixture of experts' experts split over this many ranks
    /// (replicas of the rest), which send each other the tokens routed to them; a divisor of
    /// the experts.
    #[arg(long, default_value_t = 1, value_parser = crate::train::positive)]
    pub ep: usize,
    /// Rerun the whole context for every token instead of keeping its keys and values (the
    /// same tokens, slower; Hugging Face's `use_cache=False`).
    #[arg(long)]
    pub no_kv_cache: bool,
}

/// Fails when `tok` is not the tokenizer whose SHA-256 the checkpoint recorded (`want`): its
/// ids would decode to other text.
fn check_tokenizer(tok: Option<&Tokenizer>, want: Option<&str>) -> Result<()> {
    match (tok, want) {
        (Some(t), Some(want)) if t.sha256() != want => Err(invalid!(
            "--tokenizer `{}` is not the tokenizer the checkpoint was trained with (sha256 {} \
             against {}): its ids would decode to other text; give that tokenizer",
            t.path().display(),
            &t.sha256()[..12],
            &want[..want.len().min(12)]
        )),
        _ => Ok(()),
    }
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let mut trained_on = None;
    let (model, source) = match (&a.checkpoint, &a.init_from) {
        (Some(c), None) => {
            let run = pipewright_models::RunSpec::of_checkpoint(&Reader::open(c)?)?;
            if let TaskSpec::Tokens {
                tokenizer_sha256, ..
            } = &run.task
            {
                trained_on = Some(tokenizer_sha256.clone()).filter(|s| !s.is_empty());
            }
            (run.model, c.clone())
        }
        (None, Some(d)) => (hf::config_from_dir(d)?, d.clone()),
        _ => {
            return Err(invalid!(
                "name the model: --checkpoint DIR or --init-from DIR"
            ))
        }
    };
    let sampling = Sampling {
        temperature: a.temperature,
        top_k: a.top_k,
        seed: a.seed,
        use_cache: !a.no_kv_cache,
        ..model.sampling(a.max_new_tokens)?
    };
    let tok = a.tokenizer.as_deref().map(Tokenizer::load).transpose()?;
    check_tokenizer(tok.as_ref(), trained_on.as_deref())?;
    let prompt = match (&a.prompt, &a.prompt_ids, &tok) {
        (Some(text), None, Some(t)) => t.encode(text)?,
        (Some(_), None, None) => {
            return Err(invalid!("--prompt needs --tokenizer FILE to encode it"))
        }
        (None, Some(ids), _) => ids.clone(),
        _ => {
            return Err(invalid!(
                "give --prompt TEXT (with --tokenizer) or --prompt-ids 1,2,3"
            ))
        }
    };
    let (seq, tied) = (model.build()?, model.tied());
    let layout = Layout::new(a.pp, a.tp, a.ep)?.with_ep(a.ep)?;
    let opts = VarunaOptions {
        shared_weights: tied,
        ..VarunaOptions::new(layout, layout.dp, 1)
    };
    // A bad layout fails here, before its ranks are started.
    opts.validate(&seq, layout.world())?;
    // The text needs every id; the ids alone stream and keep nothing.
    let keep = tok.is_some();
    if keep {
        pipewright::runtime::memory::check_fits(
            a.max_new_tokens as f64 * 4.0,
            &format!("decoding {} generated tokens to text", a.max_new_tokens),
            "ask for fewer tokens (--max-new-tokens), or leave out --tokenizer to stream ids",
        )?;
    }
    let from_checkpoint = a.checkpoint.is_some();
    let mut out = local::run(layout.world(), |comm| {
        let first = pipewright::distributed::comm::Communicator::rank(&comm) == 0;
        let mut v = Varuna::new(&seq, Box::new(comm), opts.clone())?;
        v.set_optimizer(|ps| OptimizerConfig::default().build(ps, &[]))?;
        if from_checkpoint {
            v.load_checkpoint(&source)?;
        } else {
            v.load_pretrained(&source, &|n| model.hf_names(n))?;
        }
        let (mut ids, mut sep) = (Vec::new(), "ids ");
        v.generate_each(&prompt, &sampling, &mut |id| {
            if first {
                pipewright::runtime::console::say_text(&format!("{sep}{id}"));
                sep = ",";
            }
            if keep {
                ids.push(id);
            }
        })?;
        if first {
            pipewright::say!();
        }
        Ok(ids)
    })?;
    let ids = out.remove(0);
    if let Some(t) = &tok {
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= t.vocab_size()) {
            return Err(invalid!(
                "the model drew id {bad}, which --tokenizer `{}` (ids below {}) cannot decode: \
                 give the tokenizer the model was trained with",
                t.path().display(),
                t.vocab_size()
            ));
        }
        pipewright::say!("{}{}", t.decode(&prompt)?, t.decode(&ids)?);
    }
    Ok(())
}
