//! Sampling from a trained language model on any layout of ranks: every rank runs the same
//! loop on the same logits (the last stage's output, whole, on every rank) with the same seeded
//! draws, so all ranks agree on every token. With a key/value cache (the default) the prompt
//! runs once and each new token alone after it, each rank caching the keys and values of its
//! own layers and heads; once the context outgrows the model's `block_size`, the window of the
//! last `block_size` tokens runs again whole (a model only knows positions below it), so the
//! tokens are the same with and without the cache.

use candle_core::{Device, IndexOp, Tensor};
use rand::Rng;

use super::Varuna;
use crate::model::batch::Batch;
use crate::model::KvCache;
use crate::{invalid, Error, Result};

/// How [`Varuna::generate`] draws tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// Tokens to add.
    pub max_new_tokens: usize,
    /// Softmax temperature; 0 takes the most likely token (greedy decoding).
    pub temperature: f64,
    /// Draw among the `k` most likely tokens only.
    pub top_k: Option<usize>,
    /// Seeds the draws.
    pub seed: u64,
    /// The model's positions (its block size).
    pub block_size: usize,
    /// Whether the model's positions go on past `block_size` (rotary embeddings, the Llama
    /// family: generation continues as transformers' does); learned positions (GPT-2's) end
    /// there, and a generation that would pass them is refused.
    pub extends: bool,
    /// Ids that may be drawn (`0..vocab`: a vocabulary padded for tensor parallelism has ids
    /// no data holds).
    pub vocab: usize,
    /// Keep the keys and values of the tokens seen (Hugging Face's `use_cache`): each new
    /// token costs one token's forward instead of the whole context's.
    pub use_cache: bool,
}

impl Sampling {
    /// Greedy decoding of `max_new_tokens` tokens by a model of `block_size` learned
    /// positions (set [`Sampling::extends`] for rotary ones).
    pub fn greedy(max_new_tokens: usize, block_size: usize, vocab: usize) -> Self {
        Self {
            max_new_tokens,
            temperature: 0.0,
            top_k: None,
            seed: 0,
            block_size,
            extends: false,
            vocab,
            use_cache: true,
        }
    }
}

/// The token `s` draws from `logits` (of the last position).
fn pick(logits: &[f32], s: &Sampling, rng: &mut impl Rng) -> u32 {
    let n = logits.len().min(s.vocab);
    let best = |i: &usize, j: &usize| logits[*i].total_cmp(&logits[*j]);
    if s.temperature == 0.0 {
        // The first of equal maxima, as torch.argmax.
        let top = (0..n).rev().max_by(best).unwrap_or(0);
        return top as u32;
    }
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by(|i, j| best(j, i));
    order.truncate(s.top_k.unwrap_or(n).clamp(1, n.max(1)));
    let top = logits[order[0]] as f64;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i] as f64 - top) / s.temperature).exp())
        .collect();
    let mut u = rng.random::<f64>() * weights.iter().sum::<f64>();
    for (&i, w) in order.iter().zip(&weights) {
        if u < *w {
            return i as u32;
        }
        u -= w;
    }
    order[order.len() - 1] as u32
}

impl Varuna {
    /// The `s.max_new_tokens` tokens that follow `prompt` (collective: every rank calls it and
    /// gets the same tokens).
    pub fn generate(&self, prompt: &[u32], s: &Sampling) -> Result<Vec<u32>> {
        crate::runtime::memory::check_fits(
            s.max_new_tokens as f64 * 4.0,
            &format!("keeping {} generated tokens", s.max_new_tokens),
            "ask for fewer tokens, or take them one by one (Varuna::generate_each)",
        )?;
        let mut out = Vec::new();
        self.generate_each(prompt, s, &mut |id| out.push(id))?;
        Ok(out)
    }

    /// [`Varuna::generate`] handing each token to `each` as soon as it is drawn (a command
    /// streams them): a long generation shows its progress. A model of learned positions
    /// generates up to its block size (past it is refused, as transformers' GPT-2 fails); one
    /// of rotary positions goes on past it with the whole context, as transformers' Llama
    /// does, as far as memory holds its cache.
    pub fn generate_each(
        &self,
        prompt: &[u32],
        s: &Sampling,
        each: &mut dyn FnMut(u32),
    ) -> Result<()> {
        if prompt.is_empty() {
            return Err(invalid!("generation needs a prompt of at least one token"));
        }
        if !(s.temperature >= 0.0 && s.temperature.is_finite()) || s.top_k == Some(0) {
            return Err(invalid!(
                "temperature must be 0 (greedy) or more and top-k at least 1, got {} and {:?}",
                s.temperature,
                s.top_k
            ));
        }
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= s.vocab) {
            return Err(invalid!(
                "prompt token {bad} is outside the vocabulary of {}",
                s.vocab
            ));
        }
        let total = prompt.len().saturating_add(s.max_new_tokens);
        if !s.extends && total > s.block_size {
            return Err(invalid!(
                "the prompt's {} tokens and {} new ones pass the model's {} learned positions: \
                 ask for at most {} new tokens, or shorten the prompt",
                prompt.len(),
                s.max_new_tokens,
                s.block_size,
                s.block_size.saturating_sub(prompt.len())
            ));
        }
        let mut rng = crate::runtime::seed::rng_for(s.seed, "generate");
        // The whole context fits the positions (learned ones were checked above; rotary ones go
        // on): nothing is ever cropped.
        let cache = s.use_cache.then(KvCache::new);
        let mut ids = prompt.to_vec();
        for drawn in 0..s.max_new_tokens {
            // The prompt first; then, with a cache, the last token drawn follows the cached
            // ones, and without one the whole context runs again.
            let fresh = match &cache {
                Some(c) if c.past() > 0 => &ids[ids.len() - 1..],
                _ => &ids[..],
            };
            let logits = self.predict_tokens(fresh, cache.as_ref())?;
            if let Some(c) = cache.as_ref().filter(|c| c.past() == fresh.len()) {
                // Once the prompt is cached, its size per token says what the whole will hold.
                let per_token = c.bytes() as f64 / c.past().max(1) as f64;
                crate::runtime::memory::check_fits(
                    per_token * total as f64,
                    &format!("a key/value cache of {total} tokens"),
                    "ask for fewer new tokens, or generate without the cache (--no-kv-cache)",
                )?;
            }
            let last: Vec<f32> = logits.i((0, fresh.len() - 1))?.to_vec1()?;
            if last.iter().any(|l| l.is_nan() || *l == f32::INFINITY) {
                return Err(Error::State(format!(
                    "the model's logits after {} tokens are not finite (NaN or infinity): its \
                     weights are, or overflow; check the checkpoint or the weights given to \
                     --init-from (a run that diverged saves such weights)",
                    prompt.len() + drawn
                )));
            }
            let id = pick(&last, s, &mut rng);
            each(id);
            if cache.is_some() {
                // The cache holds the rest: only the last token is read again.
                ids.clear();
            }
            ids.push(id);
        }
        Ok(())
    }

    /// The logits `(1, tokens, vocab)` of one sequence's `tokens`, following the tokens already
    /// in `cache` when one is given (which then holds these too): the step a decoding loop of
    /// one's own (beam search, speculative decoding) repeats. Collective over the pipeline.
    pub fn predict_tokens(&self, tokens: &[u32], cache: Option<&KvCache>) -> Result<Tensor> {
        if tokens.is_empty() {
            return Err(invalid!("predict_tokens needs at least one token"));
        }
        if let Some(c) = cache {
            c.check_room(tokens.len())?;
        }
        let x = Tensor::from_vec(tokens.to_vec(), (1, tokens.len()), &Device::Cpu)?;
        let batch = Batch::new().with(Batch::INPUTS, x);
        self.check_batch(&batch, false)?;
        if self.cp.size() > 1 {
            return Err(invalid!(
                "decoding with a key/value cache runs at cp 1: load the checkpoint into a \
                 layout without context parallelism to generate"
            ));
        }
        let batch = batch.to_device(&self.opts.device)?;
        let r = self
            .pipeline
            .stage()
            .forward_cached(&batch, false, true, cache)?;
        if let Some(c) = cache {
            c.advance(tokens.len());
        }
        Ok(r.output.expect("asked for the output"))
    }
}
