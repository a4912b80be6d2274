//! [`ring_attention`]: causal attention with the sequence split over a context-parallel ring,
//! keeping no scores (ring flash attention, as torchtitan's and Megatron's context parallelism).
//!
//! Each rank keeps its queries (two chunks, see [`super::Chunks`]) and, over `cp` steps, sees
//! every rank's keys and values: at step `s` it holds rank `r - s`'s block and passes it on
//! (`ring::pass_on`). A (query chunk, key chunk) pair is skipped when the keys all lie
//! after the queries, masked causally when they are the same chunk, and whole otherwise; with
//! the front-and-back chunks every rank computes the same number of pairs. Blocks merge into
//! an online softmax (a running maximum, sum and weighted values per query, in f32, or f64 for
//! f64 inputs), which equals the softmax over all keys at once.
//!
//! The whole ring is one autograd op: its forward keeps only the output and each query's
//! softmax maximum and sum (besides the inputs), not the scores nor the blocks it was passed, so
//! a rank's attention memory is its own tokens'. The backward passes the key/value blocks around
//! the ring again with their gradients beside them: each rank recomputes its pairs'
//! probabilities from the maximum and sum, adds its share to the block's gradients and passes both on; after the
//! last step one more pass brings each block's gradients home.

use std::cell::RefCell;

use candle_core::{DType, Tensor, D};

use super::ring::pass_on;
use super::Chunks;
use crate::distributed::comm::{precomputed3, Group};
use crate::model::nn::causal_mask;
use crate::{invalid, Result};

/// Tags of the ring's messages: the forward's key/value blocks, the backward's blocks with
/// their gradients.
const FORWARD_TAG: u64 = 0xC0F;
const BACKWARD_TAG: u64 = 0xC0B;

/// The running softmax of one query chunk.
struct Online {
    /// Running maximum of the scores.
    max: Tensor,
    /// Sum of `exp(score - max)` over the keys seen.
    sum: Tensor,
    /// Sum of `exp(score - max) * value` over the keys seen.
    acc: Tensor,
}

impl Online {
    /// Merges the `scores` `(b, h, q, k)` of one key block with its `values` `(b, h, k, d)`.
    fn add(state: Option<Self>, scores: &Tensor, values: &Tensor) -> Result<Self> {
        let block_max = scores.max_keepdim(D::Minus1)?;
        let max = match &state {
            Some(s) => s.max.maximum(&block_max)?,
            None => block_max,
        };
        let p = scores.broadcast_sub(&max)?.exp()?;
        let sum = p.sum_keepdim(D::Minus1)?;
        let acc = p.matmul(values)?;
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

    /// The chunk's output and its queries' softmax statistics `(b, h, q, 2)`: the maximum
    /// and the reciprocal of the sum (the backward's `exp(score - max) / sum` rounds as the
    /// forward's probabilities did; a log-sum-exp would add a rounding of its own).
    fn finish(self) -> Result<(Tensor, Tensor)> {
        let inv = self.sum.recip()?;
        let stats = Tensor::cat(&[&self.max, &inv], 3)?;
        Ok((self.acc.broadcast_mul(&inv)?, stats))
    }
}

/// One rank's part of the ring: shapes, chunks and the working dtype.
#[derive(Clone)]
struct Ring {
    ring: Group,
    me: Chunks,
    /// Tokens per chunk.
    c: usize,
    dims: (usize, usize, usize, usize),
    kv_heads: usize,
    rep: usize,
    scale: f64,
    /// f32 or wider: half-precision inputs accumulate in f32.
    work: DType,
}

impl Ring {
    /// Keys or values `(b, kv_heads, c, d)` for every query head (grouped-query attention).
    fn repeat(&self, y: Tensor) -> Result<Tensor> {
        if self.rep == 1 {
            return Ok(y.contiguous()?);
        }
        let (b, h, _, hd) = self.dims;
        Ok(y.unsqueeze(2)?
            .broadcast_as((b, self.kv_heads, self.rep, self.c, hd))?
            .reshape((b, h, self.c, hd))?)
    }

    /// The gradient of [`Ring::repeat`]'s input: the query heads' gradients summed per key/value
    /// head.
    fn unrepeat(&self, g: Tensor) -> Result<Tensor> {
        if self.rep == 1 {
            return Ok(g);
        }
        let (b, _, _, hd) = self.dims;
        Ok(g.reshape((b, self.kv_heads, self.rep, self.c, hd))?
            .sum(2)?)
    }

    /// `q` in the working dtype, scaled, in its two chunks.
    fn queries(&self, q: &Tensor) -> Result<[Tensor; 2]> {
        let q = (q.to_dtype(self.work)? * self.scale)?;
        Ok([q.narrow(2, 0, self.c)?, q.narrow(2, self.c, self.c)?])
    }

    /// Calls `pair(step's block, query chunk, key chunk's half, scores)` for every pair this
    /// rank computes, passing the blocks `kv` (keys and values stacked, plus anything that
    /// travels with them) around the ring with `tag`; `after(block, step)` may replace the
    /// block before it is passed on.
    fn pairs(
        &self,
        mut kv: Tensor,
        q: &[Tensor; 2],
        tag: u64,
        mut pair: impl FnMut(&Tensor, usize, usize, &Tensor) -> Result<()>,
        mut after: impl FnMut(Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let n = self.me.size;
        let q_at = self.me.indices();
        let diagonal = causal_mask(self.c, self.c, self.work, kv.device())?;
        for s in 0..n {
            if s > 0 {
                kv = pass_on(&kv, &self.ring, tag)?;
            }
            let from = Chunks {
                rank: (self.me.rank + n - s) % n,
                size: n,
            };
            for (half, k_at) in from.indices().into_iter().enumerate() {
                let keys = self.repeat(kv.get(0)?.narrow(2, half * self.c, self.c)?)?;
                for (i, qi) in q.iter().enumerate() {
                    if k_at > q_at[i] {
                        continue;
                    }
                    let mut scores = qi.matmul(&keys.t()?)?;
                    if k_at == q_at[i] {
                        scores = scores.broadcast_add(&diagonal)?;
                    }
                    pair(&kv, i, half, &scores)?;
                }
            }
            kv = after(kv)?;
        }
        Ok(kv)
    }

    /// The output `(b, h, t, d)` and the queries' softmax statistics `(b, h, t, 2)` (working
    /// dtype).
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let q = self.queries(q)?;
        let mut state: [Option<Online>; 2] = [None, None];
        let kv = Tensor::stack(&[k, v], 0)?.to_dtype(self.work)?;
        let c = self.c;
        self.pairs(
            kv,
            &q,
            FORWARD_TAG,
            |kv, i, half, scores| {
                let values = self.repeat(kv.get(1)?.narrow(2, half * c, c)?)?;
                state[i] = Some(Online::add(state[i].take(), scores, &values)?);
                Ok(())
            },
            Ok,
        )?;
        let [a, z] = state.map(|s| s.expect("every query chunk sees its own chunk"));
        let ((ya, la), (yz, lz)) = (a.finish()?, z.finish()?);
        Ok((Tensor::cat(&[ya, yz], 2)?, Tensor::cat(&[la, lz], 2)?))
    }

    /// The gradients of `q`, `k` and `v` from the output `out`, its gradient `grad` and the
    /// softmax statistics `stats` the forward kept.
    fn backward(
        &self,
        [q, k, v]: [&Tensor; 3],
        out: &Tensor,
        grad: &Tensor,
        stats: &Tensor,
    ) -> Result<Vec<Tensor>> {
        let (c, w) = (self.c, self.work);
        let qs = self.queries(q)?;
        let g = grad.to_dtype(w)?;
        // Each query's sum of gradient x output: the softmax backward's shift.
        let shift = (&g * out.to_dtype(w)?)?.sum_keepdim(D::Minus1)?;
        let half = |x: &Tensor, i: usize| x.narrow(2, i * c, c);
        let (g, shift, stats) = (
            [half(&g, 0)?, half(&g, 1)?],
            [half(&shift, 0)?, half(&shift, 1)?],
            [half(stats, 0)?, half(stats, 1)?],
        );
        let mut dq: [Option<Tensor>; 2] = [None, None];
        // Keys, values and their gradients travel together: (4, b, kv_heads, t, d).
        let kv = Tensor::stack(&[k, v], 0)?.to_dtype(w)?;
        let blocks = Tensor::cat(&[&kv, &kv.zeros_like()?], 0)?;
        // This step's gradient of the held block's two halves: [half] of (dk, dv).
        let dkv: RefCell<[Option<(Tensor, Tensor)>; 2]> = RefCell::new([None, None]);
        let add = |a: Option<Tensor>, b: Tensor| -> Result<Tensor> {
            Ok(match a {
                Some(a) => (a + b)?,
                None => b,
            })
        };
        let home = self.pairs(
            blocks,
            &qs,
            BACKWARD_TAG,
            |kv, i, h, scores| {
                let keys = self.repeat(kv.get(0)?.narrow(2, h * c, c)?)?;
                let values = self.repeat(kv.get(1)?.narrow(2, h * c, c)?)?;
                let (max, inv) = (stats[i].narrow(3, 0, 1)?, stats[i].narrow(3, 1, 1)?);
                let p = scores.broadcast_sub(&max)?.exp()?.broadcast_mul(&inv)?;
                let dv = p.t()?.matmul(&g[i])?;
                let dp = g[i].matmul(&values.t()?)?;
                let ds = (p * dp.broadcast_sub(&shift[i])?)?;
                dq[i] = Some(add(dq[i].take(), ds.matmul(&keys)?)?);
                let dk = ds.t()?.matmul(&qs[i])?;
                let mut held = dkv.borrow_mut();
                held[h] = Some(match held[h].take() {
                    Some((a, b)) => ((a + dk)?, (b + dv)?),
                    None => (dk, dv),
                });
                Ok(())
            },
            |blocks| {
                // Adds this rank's share to the held block's gradients before it moves on.
                let mut parts = Vec::with_capacity(2);
                for h in 0..2 {
                    let (dk, dv) = match dkv.borrow_mut()[h].take() {
                        Some((dk, dv)) => (self.unrepeat(dk)?, self.unrepeat(dv)?),
                        None => {
                            let z = blocks.get(0)?.narrow(2, h * c, c)?.zeros_like()?;
                            (z.clone(), z)
                        }
                    };
                    parts.push(Tensor::stack(&[dk, dv], 0)?);
                }
                let mine = Tensor::cat(&parts, 3)?;
                let grads = (blocks.narrow(0, 2, 2)? + mine)?;
                Ok(Tensor::cat(&[&blocks.narrow(0, 0, 2)?, &grads], 0)?)
            },
        )?;
        // The block held last is the next rank's: one more pass brings every block's
        // gradients home.
        let grads = pass_on(&home.narrow(0, 2, 2)?, &self.ring, BACKWARD_TAG)?;
        let [a, z] = dq.map(|d| d.expect("every query chunk sees its own chunk"));
        let dq = (Tensor::cat(&[a, z], 2)? * self.scale)?.to_dtype(q.dtype())?;
        Ok(vec![
            dq,
            grads.get(0)?.to_dtype(k.dtype())?,
            grads.get(1)?.to_dtype(v.dtype())?,
        ])
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
    ring: &Group,
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
    let r = Ring {
        ring: ring.clone(),
        me: Chunks::of(ring),
        c: t / 2,
        dims: (b, h, t, hd),
        kv_heads: kvh,
        rep,
        scale,
        work: if q.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        },
    };
    let (out, stats) = r.forward(&q.detach(), &k.detach(), &v.detach())?;
    let out = out.to_dtype(q.dtype())?;
    precomputed3([q, k, v], out, "ring-attention", move |args, out, grad| {
        r.backward([args[0], args[1], args[2]], out, grad, &stats)
    })
}
