//! [`KvCache`]: the keys and values of the tokens a language model has already seen, kept per
//! attention layer between forwards, so that decoding a new token runs the model over that
//! token alone (Hugging Face's `past_key_values`, torchtitan's and Megatron's inference cache).
//!
//! Conventions: a forward through a cache takes the tokens at positions `past..past + t`, where
//! `past` is [`KvCache::past`]; each attention layer appends its new keys and values along the
//! time dimension (dim 2 of `(batch, heads, time, head_dim)`, its own heads under tensor
//! parallelism: each rank caches only what it computes) and attends over all of them; the caller
//! calls [`KvCache::advance`] once the forward is over. A cache belongs to one sequence batch:
//! [`KvCache::clear`] before another.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::Tensor;

use crate::{Error, Result};

#[derive(Debug, Default)]
struct State {
    past: usize,
    capacity: Option<usize>,
    layers: HashMap<String, (Tensor, Tensor)>,
}

/// Cached keys and values per attention layer of this rank's stages (cheap to clone: the
/// clones share one store, so a [`crate::model::Cx`] can carry it into every layer).
#[derive(Clone, Debug, Default)]
pub struct KvCache(Arc<Mutex<State>>);

impl KvCache {
    /// An empty cache.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty cache of at most `tokens` tokens (the model's window): a forward that would
    /// pass it is refused on every rank before it starts, so no rank waits on another.
    pub fn with_capacity(tokens: usize) -> Self {
        let c = Self::default();
        c.state().capacity = Some(tokens);
        c
    }

    /// Refuses `tokens` more when they would pass the capacity.
    pub fn check_room(&self, tokens: usize) -> Result<()> {
        let s = self.state();
        match s.capacity {
            Some(cap) if s.past + tokens > cap => Err(crate::invalid!(
                "the key/value cache holds {} of its {cap} tokens (the model's block_size): {tokens} more do not fit; clear it and run the last {cap} tokens again",
                s.past
            )),
            _ => Ok(()),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Tokens already cached: the position of the first token of the next forward.
    pub fn past(&self) -> usize {
        self.state().past
    }

    /// Appends layer `layer`'s keys and values of the new tokens (`(batch, heads, t, hd)`) and
    /// returns all of them, cached and new, for the attention over the whole context.
    pub fn append(&self, layer: &str, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let mut s = self.state();
        let past = s.past;
        // Detached: a kept tensor would otherwise hold the graph of every forward that made it.
        let (k, v) = (&k.detach(), &v.detach());
        let whole = match s.layers.get(layer) {
            None if past == 0 => (k.clone(), v.clone()),
            None => {
                return Err(Error::Layer {
                    layer: layer.into(),
                    msg: format!(
                        "the key/value cache holds {past} tokens but none of this layer's: a \
                         cache serves one model; clear it before another"
                    ),
                })
            }
            Some((ck, cv)) => {
                if ck.dim(2)? != past {
                    return Err(Error::Layer {
                        layer: layer.into(),
                        msg: format!(
                            "the key/value cache holds {} tokens of this layer where the model \
                             has seen {past}: advance the cache once after every forward",
                            ck.dim(2)?
                        ),
                    });
                }
                (Tensor::cat(&[ck, k], 2)?, Tensor::cat(&[cv, v], 2)?)
            }
        };
        s.layers.insert(layer.to_string(), whole.clone());
        Ok(whole)
    }

    /// Marks the `tokens` of the forward just run as cached (after every forward through it).
    pub fn advance(&self, tokens: usize) {
        self.state().past += tokens;
    }

    /// Empties the cache (a new sequence, or a context that slid past the model's window).
    pub fn clear(&self) {
        let mut s = self.state();
        s.past = 0;
        s.layers.clear();
    }

    /// Bytes of the cached tensors on this rank.
    pub fn bytes(&self) -> usize {
        self.state()
            .layers
            .values()
            .map(|(k, v)| (k.elem_count() + v.elem_count()) * k.dtype().size_in_bytes())
            .sum()
    }
}
