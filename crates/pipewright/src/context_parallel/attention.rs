//! [`ring_attention`]: causal attention with the sequence split over a context-parallel ring.
//!
//! Each rank keeps its queries (two chunks, see [`super::Chunks`]) and, over `cp` steps, sees
//! every rank's keys and values: at step `s` it holds rank `r - s`'s block and passes it on
//! ([`super::ring_shift`]). A (query chunk, key chunk) pair is skipped when the keys all lie
//! after the queries, masked causally when they are the same chunk, and whole otherwise; with
//! the front-and-back chunks every rank computes the same number of pairs. Blocks merge into
//! an online softmax (a running maximum, sum and weighted values per query, in f32, or f64
//! for f64 inputs), which
//! equals the softmax over all keys at once. The running maximum is only a shift for
//! stability and is held out of the graph; autograd differentiates the rest, so the backward
//! recomputes nothing and the key/value gradients travel back around the ring through the
//! shifts' backward.

use candle_core::{DType, Tensor, D};

use super::{ring_shift, Chunks};
use crate::comm::TpGroup;
use crate::nn::causal_mask;
use crate::{invalid, Result};

/// The running softmax of one query chunk.
struct Online {
    /// Running maximum of the scores (no gradient).
    max: Tensor,
    /// Sum of `exp(score - max)` over the keys seen.
    sum: Tensor,
    /// Sum of `exp(score - max) * value` over the keys seen.
    acc: Tensor,
}

impl Online {
    /// Merges the `scores` `(b, h, q, k)` of one key block with its `values` `(b, h, k, d)`
    /// (both in the working dtype).
    fn add(state: Option<Self>, scores: &Tensor, values: &Tensor) -> Result<Self> {
        let block_max = scores.max_keepdim(D::Minus1)?.detach();
        let max = match &state {
            Some(s) => s.max.maximum(&block_max)?,
            None => block_max,
        };
        let p = scores.broadcast_sub(&max)?.exp()?;
        let sum = p.sum_keepdim(D::Minus1)?;
        let acc = p.matmul(&values.contiguous()?)?;
        Ok(match state {
            None => Self { max, sum, acc },
            Some(s) => {
                let fade = (s.max - &max)?.exp()?;
                Self {
                    sum: (s.sum.broadcast_mul(&fade)? + sum)?,
                    acc: (s.acc.broadcast_mul(&fade)? + acc)?,
                    max,
                }
            }
        })
    }

    fn finish(self) -> Result<Tensor> {
        Ok(self.acc.broadcast_div(&self.sum)?)
    }
}

/// Causal attention of this rank's queries `q` `(batch, heads, t, head_dim)` over the whole
/// sequence, whose keys and values `k`, `v` `(batch, heads / rep, t, head_dim)` are split over
/// `ring` as [`Chunks`] says (`t` is this rank's tokens: two chunks). Each key/value head
/// serves `rep` query heads in a row (grouped-query attention; 1 for plain multi-head). Scores
/// are scaled by `scale`. Returns `(batch, heads, t, head_dim)` in `q`'s dtype.
pub fn ring_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    rep: usize,
    ring: &TpGroup,
) -> Result<Tensor> {
    let (b, h, t, hd) = q.dims4()?;
    let kvh = k.dim(1)?;
    if !t.is_multiple_of(2) || kvh * rep != h || k.dims() != v.dims() || k.dim(2)? != t {
        return Err(invalid!(
            "ring attention: queries {:?}, keys {:?} and values {:?} do not match (two equal \
             chunks of tokens per rank, {rep} query heads per key/value head)",
            q.dims(),
            k.dims(),
            v.dims()
        ));
    }
    let me = Chunks::of(ring);
    let n = me.size;
    let c = t / 2;
    // f32 or wider: half-precision inputs accumulate in f32.
    let work = if q.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let q = (q.to_dtype(work)? * scale)?;
    let q_parts = [q.narrow(2, 0, c)?, q.narrow(2, c, c)?];
    let q_at = me.indices();
    let diagonal = causal_mask(c, c, work, q.device())?;
    let repeat = |y: Tensor| -> Result<Tensor> {
        if rep == 1 {
            return Ok(y);
        }
        Ok(y.unsqueeze(2)?
            .broadcast_as((b, kvh, rep, c, hd))?
            .reshape((b, h, c, hd))?)
    };
    let mut state: [Option<Online>; 2] = [None, None];
    // Keys and values travel together: one message per step.
    let mut kv = Tensor::stack(&[k, v], 0)?;
    for s in 0..n {
        if s > 0 {
            kv = ring_shift(&kv, ring)?;
        }
        let from = Chunks {
            rank: (me.rank + n - s) % n,
            size: n,
        };
        for (half, k_at) in from.indices().into_iter().enumerate() {
            let block = kv.narrow(3, half * c, c)?;
            let keys = repeat(block.get(0)?)?.to_dtype(work)?;
            let values = repeat(block.get(1)?)?.to_dtype(work)?;
            for (i, qi) in q_parts.iter().enumerate() {
                if k_at > q_at[i] {
                    continue;
                }
                let mut scores = qi.matmul(&keys.t()?)?;
                if k_at == q_at[i] {
                    scores = scores.broadcast_add(&diagonal)?;
                }
                state[i] = Some(Online::add(state[i].take(), &scores, &values)?);
            }
        }
    }
    let [a, z] = state.map(|s| s.expect("every query chunk sees its own chunk"));
    Ok(Tensor::cat(&[a.finish()?, z.finish()?], 2)?.to_dtype(k.dtype())?)
}
