//! Sampling from a trained language model on any layout of ranks: every rank runs the same
//! loop on the same logits (the last stage's output, whole, on every rank) with the same seeded
//! draws, so all ranks agree on every token. Each new token runs the model over the context
//! again (at most the model's `block_size` last tokens): there is no key/value cache yet.

use candle_core::{Device, IndexOp, Tensor};
use rand::Rng;

use super::Varuna;
use crate::batch::Batch;
use crate::{invalid, Result};

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
    /// The longest context the model takes (older tokens are left out).
    pub block_size: usize,
    /// Ids that may be drawn (`0..vocab`: a vocabulary padded for tensor parallelism has ids
    /// no data holds).
    pub vocab: usize,
}

impl Sampling {
    /// Greedy decoding of `max_new_tokens` tokens.
    pub fn greedy(max_new_tokens: usize, block_size: usize, vocab: usize) -> Self {
        Self {
            max_new_tokens,
            temperature: 0.0,
            top_k: None,
            seed: 0,
            block_size,
            vocab,
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
        let mut rng = crate::init::rng_for(s.seed, "generate");
        let mut ids = prompt.to_vec();
        for _ in 0..s.max_new_tokens {
            let ctx = &ids[ids.len().saturating_sub(s.block_size.max(1))..];
            let x = Tensor::from_vec(ctx.to_vec(), (1, ctx.len()), &Device::Cpu)?;
            let logits = self.predict(&Batch::new().with(Batch::INPUTS, x))?;
            let last: Vec<f32> = logits.i((0, ctx.len() - 1))?.to_vec1()?;
            ids.push(pick(&last, s, &mut rng));
        }
        Ok(ids[prompt.len()..].to_vec())
    }
}
