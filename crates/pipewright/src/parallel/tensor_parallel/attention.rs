//! Causal multi-head self-attention (GPT-2), with explicit softmax so gradients flow.
//!
//! Built with a tensor-parallel group of more than one rank it is Megatron's attention: `c_attn` is
//! column-parallel with the heads split (each rank keeps its heads' q, k and v columns),
//! `c_proj` row-parallel, so each rank attends with its own heads and one all-reduce joins
//! them.
//!
//! On a context-parallel ring ([`CausalSelfAttention::on_ring`]) each rank holds a slice of
//! the sequence and attends over the whole of it with [`crate::parallel::context_parallel::ring_attention`].

use candle_core::{Tensor, Var};

use super::{ParallelDim, ParallelLinear, SequenceParallel};
use crate::distributed::comm::Group;
use crate::model::init::Init;
use crate::model::nn::{fused_causal_attention, join, scaled_softmax, Dropout, Linear, Module};
use crate::model::Cx;
use crate::model::Shard;
use crate::parallel::context_parallel::ring_attention;
use crate::{Error, Result};

/// GPT-2 attention: `c_attn` projects to q, k, v (one `(d, 3d)` matrix), heads attend causally,
/// `c_proj` projects back. Parameter names follow Hugging Face GPT-2.
#[derive(Clone, Debug)]
pub struct CausalSelfAttention {
    name: String,
    c_attn: ParallelLinear,
    c_proj: ParallelLinear,
    attn_dropout: Dropout,
    resid_dropout: Dropout,
    n_head: usize,
    /// Heads on this rank.
    local_heads: usize,
    tp_rank: usize,
    /// The context-parallel ring the sequence is split over (a group of one: whole).
    ring: Group,
    /// Sequence parallelism: the input and output are this rank's part of the sequence.
    sp: SequenceParallel,
}

impl CausalSelfAttention {
    /// `proj_std` is the std of `c_proj` (GPT-2 scales it by 1/sqrt(2 n_layer)).
    pub fn new(
        init: &Init,
        tp: &Group,
        name: &str,
        n_embd: usize,
        n_head: usize,
        dropout: f64,
        proj_std: f64,
    ) -> Result<Self> {
        if n_head == 0 || !n_embd.is_multiple_of(n_head) {
            return Err(Error::Layer {
                layer: name.into(),
                msg: format!("n_embd {n_embd} must be a multiple of n_head {n_head}"),
            });
        }
        if !n_head.is_multiple_of(tp.size()) {
            return Err(Error::Layer {
                layer: name.into(),
                msg: format!(
                    "{n_head} heads cannot be split over {} tensor-parallel ranks: choose n_head a \
                     multiple of the tensor-parallel size",
                    tp.size()
                ),
            });
        }
        let c_attn = Linear::conv1d(init, &join(name, "c_attn"), n_embd, 3 * n_embd, 0.02)?;
        let c_proj = Linear::conv1d(init, &join(name, "c_proj"), n_embd, n_embd, proj_std)?;
        // This rank's q | k | v columns: the key bias shifts a query's scores uniformly.
        let lc = n_embd / tp.size();
        Ok(Self {
            name: name.to_string(),
            c_attn: ParallelLinear::from_whole(c_attn, Some(ParallelDim::Column), 3, tp)?
                .map_local(|l| l.inert_bias(lc..2 * lc)),
            c_proj: ParallelLinear::from_whole(c_proj, Some(ParallelDim::Row), 1, tp)?
                .input_is_parallel(true),
            attn_dropout: Dropout::new(&join(name, "attn_dropout"), dropout),
            resid_dropout: Dropout::new(&join(name, "resid_dropout"), dropout),
            n_head,
            local_heads: n_head / tp.size(),
            tp_rank: tp.rank(),
            ring: Group::single(),
            sp: SequenceParallel::default(),
        })
    }

    /// The same attention under sequence parallelism `sp` (input and output split along the
    /// sequence over the tensor-parallel group when on).
    pub fn sequence_parallel(mut self, sp: SequenceParallel) -> Self {
        self.c_attn = self.c_attn.sequence_parallel(sp.is_on());
        self.c_proj = self.c_proj.sequence_parallel(sp.is_on());
        self.sp = sp;
        self
    }

    /// The same attention for sequences split over the context-parallel `ring` (each rank's
    /// tokens as [`crate::parallel::context_parallel::Chunks`] lays them out).
    pub fn on_ring(mut self, ring: Group) -> Self {
        self.ring = ring;
        self
    }

    /// `x`: `(batch, time, n_embd)`.
    pub fn forward(&self, x: &Tensor, cx: &mut Cx) -> Result<Tensor> {
        let (b, _, c) = x.dims3().map_err(|_| Error::Layer {
            layer: self.name.clone(),
            msg: format!("expects (batch, time, channels), got {:?}", x.dims()),
        })?;
        let hd = c / self.n_head;
        let (h, lc) = (self.local_heads, self.local_heads * hd);
        let qkv = self.c_attn.forward(x, cx)?;
        // The whole sequence (sequence parallelism gathers it in `c_attn`).
        let t = qkv.dim(1)?;
        let scale = 1.0 / (hd as f64).sqrt();
        if self.ring.size() > 1 {
            return self.forward_ring(&qkv, (b, t, h, hd), scale, cx);
        }
        if !self.attn_dropout.is_active(cx) && cx.kv_cache.is_none() {
            // One fused op from the packed q | k | v to the heads' joined outputs.
            if let Some(y) = fused_causal_attention(&qkv, h, scale)? {
                let y = self.c_proj.forward(&y, cx)?;
                return self.sp.dropout(&self.resid_dropout, &y, cx);
            }
        }
        let [q, k, v] = split_heads(&qkv, (b, t, h, hd))?;
        // Decoding: the new tokens attend over the cached ones too (the causal softmax lines
        // the last query up with the last key).
        let (k, v) = match &cx.kv_cache {
            Some(cache) => cache.append(&self.name, &k, &v)?,
            None => (k, v),
        };
        let att = scaled_softmax(&q.matmul(&k.t()?)?, scale, true)?;
        // The serial run's mask, this rank's heads of it.
        let parts = self.n_head / h;
        let att = self
            .attn_dropout
            .forward_part(&att, cx, 1, self.tp_rank, parts)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, lc))?;
        let y = self.c_proj.forward(&y, cx)?;
        self.sp.dropout(&self.resid_dropout, &y, cx)
    }
}

impl CausalSelfAttention {
    /// Attention over the ring: this rank's queries against every rank's keys and values.
    fn forward_ring(
        &self,
        qkv: &Tensor,
        (b, t, h, hd): (usize, usize, usize, usize),
        scale: f64,
        cx: &mut Cx,
    ) -> Result<Tensor> {
        if self.attn_dropout.is_active(cx) || cx.kv_cache.is_some() {
            return Err(Error::Layer {
                layer: self.name.clone(),
                msg: "attention dropout and key/value caches run at cp 1: use dropout 0 with \
                      context parallelism, and generate from a layout without it"
                    .into(),
            });
        }
        let [q, k, v] = split_heads(qkv, (b, t, h, hd))?;
        let y = ring_attention(&q, &k, &v, scale, 1, &self.ring)?;
        let y = y.transpose(1, 2)?.reshape((b, t, h * hd))?;
        let y = self.c_proj.forward(&y, cx)?;
        self.sp.dropout(&self.resid_dropout, &y, cx)
    }
}

/// q, k and v `(batch, heads, time, head_dim)` of this rank's `h` heads from the packed
/// `(batch, time, 3 * h * head_dim)` output of `c_attn`.
fn split_heads(qkv: &Tensor, (b, t, h, hd): (usize, usize, usize, usize)) -> Result<[Tensor; 3]> {
    let lc = h * hd;
    let one = |i: usize| -> Result<Tensor> {
        Ok(qkv
            .narrow(2, i * lc, lc)?
            .reshape((b, t, h, hd))?
            .transpose(1, 2)?
            .contiguous()?)
    };
    Ok([one(0)?, one(1)?, one(2)?])
}

impl Module for CausalSelfAttention {
    fn params(&self) -> Vec<(String, Var)> {
        let mut v = self.c_attn.params();
        v.extend(self.c_proj.params());
        v
    }
}

impl CausalSelfAttention {
    /// How `c_attn` and `c_proj` are split over the group (none when whole).
    pub fn shards(&self) -> Vec<(String, Shard)> {
        let mut v = self.c_attn.shards();
        v.extend(self.c_proj.shards());
        v
    }
}
