//! Llama (Meta's, as Hugging Face's `LlamaForCausalLM` computes it): RMSNorm before attention
//! and MLP, rotary position embeddings on queries and keys, grouped-query attention (fewer key
//! and value heads than query heads), a SwiGLU MLP, no biases, an untied output head.
//! Parameter names are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, stored
//! `(out, in)`), so its checkpoints map one to one.
//!
//! The same cut points as the GPT (after the embedding and after every block) and Megatron's
//! tensor-parallel split: q, k and v column-parallel with whole heads per rank (query heads and
//! key/value groups both split), `o_proj` row-parallel; `gate_proj` and `up_proj`
//! column-parallel, `down_proj` row-parallel; a vocabulary-parallel embedding and head.

use candle_core::{Tensor, Var, D};
use pipewright::model::expert_load::ExpertLoad;
use pipewright::model::nn::{
    fused_causal_attention, join, rope, scaled_softmax, swiglu, with_aux_loss, Module, RmsNorm,
};
use pipewright::model::{Activation, Cx, Layer, LayerSpec, Sequential, Shard};
use pipewright::parallel::context_parallel::{ring_attention, Chunks};
use pipewright::parallel::tensor_parallel::{
    copy_to_group, Group, ParallelDim, ParallelEmbedding, ParallelLinear, SequenceParallel,
};
use pipewright::trainer::model_spec::ModelSpec;
use pipewright::{Build, Error, Result};

use crate::gpt::{window, LmHead};
use crate::linear::linear;
use crate::moe::MoeMlp;

mod config;

pub use config::LlamaConfig;

/// The Llama as a sequential model: `embed`, `model.layers.0` .. `model.layers.{n-1}`, `norm`,
/// `lm_head`, with a cut point after the embedding and after every block.
pub fn llama(cfg: LlamaConfig) -> Result<Sequential> {
    cfg.validate()?;
    let mut s = Sequential::new();
    s.push(LayerSpec::new("embed", move |init| {
        Ok(Box::new(Embed {
            table: ParallelEmbedding::new(
                init,
                &init.tp,
                "model.embed_tokens",
                cfg.vocab_size,
                cfg.dim,
                0.02,
            )?,
            block_size: cfg.block_size,
            ring: Chunks::of(&init.cp),
            sp: SequenceParallel::new(init),
        }) as Box<dyn Layer>)
    }))
    .cut();
    for i in 0..cfg.n_layer {
        let name = format!("model.layers.{i}");
        s.push(LayerSpec::new(name.clone(), move |init| {
            Ok(Box::new(LlamaBlock::new(init, &name, i, cfg)?) as Box<dyn Layer>)
        }))
        .cut();
    }
    s.push(LayerSpec::new("model.norm", move |init| {
        Ok(Box::new(FinalNorm(
            RmsNorm::new(init, "model.norm", cfg.dim, cfg.norm_eps)?,
            SequenceParallel::new(init),
        )) as Box<dyn Layer>)
    }));
    s.push(LayerSpec::new("lm_head", move |init| {
        let head = linear(init, "lm_head", cfg.dim, cfg.vocab_size)?;
        // Sequence parallelism ends here: the head gathers the whole sequence.
        Ok(Box::new(LmHead::new(
            ParallelLinear::from_whole(head, Some(ParallelDim::Column), 1, &init.tp)?
                .sequence_parallel(init.splits_sequence()),
        )) as Box<dyn Layer>)
    }));
    Ok(s)
}

/// Split over the group on `dim` (column: whole output rows per rank; row: input columns).
fn parallel(
    init: &Build,
    name: &str,
    inp: usize,
    out: usize,
    dim: ParallelDim,
) -> Result<ParallelLinear> {
    let p = ParallelLinear::from_whole(linear(init, name, inp, out)?, Some(dim), 1, &init.tp)?
        .sequence_parallel(init.splits_sequence());
    Ok(if dim == ParallelDim::Row {
        p.input_is_parallel(true)
    } else {
        p
    })
}

/// The token embedding (vocabulary-parallel). Training refuses sequences past the window (the
/// model's block size); inference goes on past it, as transformers' Llama does: rotary
/// positions are computed for any position.
struct Embed {
    table: ParallelEmbedding,
    block_size: usize,
    ring: Chunks,
    sp: SequenceParallel,
}

impl Layer for Embed {
    fn name(&self) -> &str {
        "embed"
    }

    fn forward(&self, x: Activation, cx: &mut Cx) -> Result<Activation> {
        let ids = x.into_tensor("embed")?;
        if cx.is_training() {
            window(ids.dim(D::Minus1)?, cx, self.block_size, &self.ring)?;
        }
        Ok(self.sp.scatter(&self.table.forward(&ids, cx)?)?.into())
    }

    fn params(&self) -> Vec<(String, Var)> {
        self.table.params()
    }

    fn shards(&self) -> Vec<(String, Shard)> {
        self.table.shards()
    }
}

/// The final RMSNorm as a layer (on this rank's part of the sequence under sequence
/// parallelism).
struct FinalNorm(RmsNorm, SequenceParallel);

impl Layer for FinalNorm {
    fn name(&self) -> &str {
        self.0.name()
    }

    fn forward(&self, x: Activation, _cx: &mut Cx) -> Result<Activation> {
        let x = x.into_tensor(self.0.name())?;
        Ok(self.0.forward_with(&x, |w| self.1.weight(w))?.into())
    }

    fn params(&self) -> Vec<(String, Var)> {
        self.0.params()
    }
}

/// A block's MLP: SwiGLU split over the tensor-parallel group, or a mixture of experts.
// One a block, made once: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Mlp {
    Dense {
        gate: ParallelLinear,
        up: ParallelLinear,
        down: ParallelLinear,
    },
    Moe(MoeMlp),
}

/// A Llama block: `x + attn(norm(x))`, then `x + mlp(norm(x))`.
pub struct LlamaBlock {
    name: String,
    cfg: LlamaConfig,
    input_norm: RmsNorm,
    q: ParallelLinear,
    k: ParallelLinear,
    v: ParallelLinear,
    o: ParallelLinear,
    /// Qwen3's per-head norms of the queries and keys (whole on every tensor-parallel rank,
    /// their gradients summed over the group: each rank's heads give a part).
    qk_norm: Option<(RmsNorm, RmsNorm)>,
    tp: Group,
    post_norm: RmsNorm,
    mlp: Mlp,
    /// Query and key/value heads on this rank.
    local: (usize, usize),
    /// The context-parallel ring the sequence is split over (a group of one: whole).
    ring: Group,
    /// Sequence parallelism: the block's input and output are this rank's part of the
    /// sequence.
    sp: SequenceParallel,
}

impl LlamaBlock {
    /// Block `name`, the model's block `layer` (from 0), of `cfg`.
    pub fn new(init: &Build, name: &str, layer: usize, cfg: LlamaConfig) -> Result<Self> {
        if cfg.moe.is_some() {
            whole_mixture(init, name)?;
        }
        let tp = init.tp.size();
        if let Some(d) = cfg.tp_divides().into_iter().find(|d| d % tp != 0) {
            return Err(Error::Layer {
                layer: name.into(),
                msg: format!(
                    "{d} (heads, key/value heads, MLP width or vocabulary) cannot be split over \
                     {tp} tensor-parallel ranks: choose a tensor-parallel size that divides it"
                ),
            });
        }
        let (d, hd) = (cfg.dim, cfg.head_dim());
        let at = |s: &str| join(name, s);
        use ParallelDim::{Column, Row};
        Ok(Self {
            name: name.to_string(),
            cfg,
            input_norm: RmsNorm::new(init, &at("input_layernorm"), d, cfg.norm_eps)?,
            q: parallel(init, &at("self_attn.q_proj"), d, cfg.n_head * hd, Column)?,
            k: parallel(init, &at("self_attn.k_proj"), d, cfg.n_kv_head * hd, Column)?,
            v: parallel(init, &at("self_attn.v_proj"), d, cfg.n_kv_head * hd, Column)?,
            o: parallel(init, &at("self_attn.o_proj"), cfg.n_head * hd, d, Row)?,
            qk_norm: cfg
                .qk_norm
                .then(|| -> Result<_> {
                    let norm = |n: &str| RmsNorm::new(init, &at(n), hd, cfg.norm_eps);
                    Ok((norm("self_attn.q_norm")?, norm("self_attn.k_norm")?))
                })
                .transpose()?,
            tp: init.tp.clone(),
            post_norm: RmsNorm::new(init, &at("post_attention_layernorm"), d, cfg.norm_eps)?,
            mlp: match cfg.moe.filter(|m| m.at(layer)) {
                Some(m) => Mlp::Moe(MoeMlp::new(init, name, d, m)?),
                None => Mlp::Dense {
                    gate: parallel(init, &at("mlp.gate_proj"), d, cfg.hidden, Column)?,
                    up: parallel(init, &at("mlp.up_proj"), d, cfg.hidden, Column)?,
                    down: parallel(init, &at("mlp.down_proj"), cfg.hidden, d, Row)?,
                },
            },
            local: (cfg.n_head / tp, cfg.n_kv_head / tp),
            ring: init.cp.clone(),
            sp: SequenceParallel::new(init),
        })
    }

    fn attention(&self, x: &Tensor, cx: &mut Cx) -> Result<Tensor> {
        let (b, t, _) = x.dims3().map_err(|_| Error::Layer {
            layer: self.name.clone(),
            msg: format!("expects (batch, time, channels), got {:?}", x.dims()),
        })?;
        let past = cx.position();
        let hd = self.cfg.head_dim();
        let (h, kvh) = self.local;
        let heads = |y: Tensor, n: usize| -> Result<Tensor> {
            Ok(y.reshape((b, t, n, hd))?.transpose(1, 2)?.contiguous()?)
        };
        let mut q = heads(self.q.forward_gathered(x, cx)?, h)?;
        let mut k = heads(self.k.forward_gathered(x, cx)?, kvh)?;
        let v = heads(self.v.forward_gathered(x, cx)?, kvh)?;
        if let Some((qn, kn)) = &self.qk_norm {
            let w = |t: &Tensor| copy_to_group(t, &self.tp);
            (q, k) = (qn.forward_with(&q, w)?, kn.forward_with(&k, w)?);
        }
        let theta = self.cfg.rope_theta;
        if self.ring.size() > 1 {
            return self.ring_attention(&q, &k, &v, cx);
        }
        let (q, k) = (rope(&q, past, theta)?, rope(&k, past, theta)?);
        let scale = 1.0 / (hd as f64).sqrt();
        // Each key/value head serves `rep` query heads in a row.
        let rep = h / kvh;
        if cx.kv_cache.is_none() {
            // One fused op over q | k | v packed by time, the key/value heads repeated: no
            // (time x time) tensor kept, and flash kernels on a GPU.
            let by_time = |y: &Tensor, n: usize, rep: usize| -> Result<Tensor> {
                let y = y.transpose(1, 2)?;
                Ok(match rep {
                    1 => y.reshape((b, t, n * hd))?,
                    _ => (y.unsqueeze(3)?.broadcast_as((b, t, n, rep, hd))?).reshape((
                        b,
                        t,
                        n * rep * hd,
                    ))?,
                })
            };
            let qkv = Tensor::cat(
                &[
                    by_time(&q, h, 1)?,
                    by_time(&k, kvh, rep)?,
                    by_time(&v, kvh, rep)?,
                ],
                2,
            )?;
            if let Some(y) = fused_causal_attention(&qkv, h, scale)? {
                return self.o.forward(&y, cx);
            }
        }
        // Decoding: the cache keeps the key/value heads (not repeated: GQA's saving), and the
        // new queries attend over every cached key too.
        let (k, v) = match &cx.kv_cache {
            Some(cache) => cache.append(&self.name, &k, &v)?,
            None => (k, v),
        };
        let keys = k.dim(2)?;
        let repeat = |y: Tensor| -> Result<Tensor> {
            if rep == 1 {
                return Ok(y);
            }
            Ok(y.unsqueeze(2)?
                .broadcast_as((b, kvh, rep, keys, hd))?
                .reshape((b, h, keys, hd))?)
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let att = scaled_softmax(&q.matmul(&k.t()?)?, scale, true)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, h * hd))?;
        self.o.forward(&y, cx)
    }
}

impl LlamaBlock {
    /// Attention over the context-parallel ring: `q`, `k`, `v` `(batch, heads, t, head_dim)`
    /// of this rank's two chunks, each rotated by its own positions.
    fn ring_attention(&self, q: &Tensor, k: &Tensor, v: &Tensor, cx: &mut Cx) -> Result<Tensor> {
        if cx.kv_cache.is_some() {
            return Err(Error::Layer {
                layer: self.name.clone(),
                msg: "key/value caches run at cp 1: generate from a layout without context \
                      parallelism"
                    .into(),
            });
        }
        let (b, h, t, hd) = q.dims4()?;
        let theta = self.cfg.rope_theta;
        let at = Chunks::of(&self.ring).positions(t);
        let rotate = |y: &Tensor| -> Result<Tensor> {
            let c = t / 2;
            let halves = [
                rope(&y.narrow(2, 0, c)?, at[0].start, theta)?,
                rope(&y.narrow(2, c, c)?, at[1].start, theta)?,
            ];
            Ok(Tensor::cat(&halves, 2)?)
        };
        let rep = self.local.0 / self.local.1;
        let scale = 1.0 / (hd as f64).sqrt();
        let y = ring_attention(&rotate(q)?, &rotate(k)?, v, scale, rep, &self.ring)?;
        let y = y.transpose(1, 2)?.reshape((b, t, h * hd))?;
        self.o.forward(&y, cx)
    }
}

impl Layer for LlamaBlock {
    fn name(&self) -> &str {
        &self.name
    }

    fn forward(&self, x: Activation, cx: &mut Cx) -> Result<Activation> {
        let x = x.into_tensor(&self.name)?;
        let w = |t: &Tensor| self.sp.weight(t);
        // Into the tensor-parallel region once for q, k and v (the whole sequence under
        // sequence parallelism), once for gate and up.
        let n = self.sp.gather(&self.input_norm.forward_with(&x, w)?)?;
        let x = (&x + self.attention(&n, cx)?)?;
        let normed = self.post_norm.forward_with(&x, w)?;
        let h = match &self.mlp {
            Mlp::Dense { gate, up, down } => {
                let n = self.sp.gather(&normed)?;
                let (g, u) = (gate.forward_gathered(&n, cx)?, up.forward_gathered(&n, cx)?);
                down.forward(&swiglu(&g, &u)?, cx)?
            }
            // The router computes on every rank alike; each expert enters the tensor-parallel
            // region itself.
            Mlp::Moe(m) => {
                let r = m.forward(&normed, cx)?;
                if cx.is_training() {
                    let aux = r.aux.to_scalar::<f32>()? as f64;
                    let mut load = ExpertLoad::pass(&self.name, &r.load, aux);
                    // A context-parallel rank routed its part of the micro-batch's tokens.
                    load.passes /= self.ring.size() as f64;
                    cx.expert_loads.push(load);
                }
                with_aux_loss(&r.out, &r.aux, m.aux_coef() * cx.aux_weight)?
            }
        };
        Ok((x + h)?.into())
    }

    fn params(&self) -> Vec<(String, Var)> {
        let mut v = self.input_norm.params();
        for p in [&self.q, &self.k, &self.v, &self.o] {
            v.extend(p.params());
        }
        if let Some((qn, kn)) = &self.qk_norm {
            v.extend(qn.params());
            v.extend(kn.params());
        }
        v.extend(self.post_norm.params());
        match &self.mlp {
            Mlp::Dense { gate, up, down } => {
                for p in [gate, up, down] {
                    v.extend(p.params());
                }
            }
            Mlp::Moe(m) => v.extend(m.params()),
        }
        v
    }

    fn shards(&self) -> Vec<(String, Shard)> {
        let mut split = vec![&self.q, &self.k, &self.v, &self.o];
        if let Mlp::Dense { gate, up, down } = &self.mlp {
            split.extend([gate, up, down]);
        }
        let mut shards: Vec<(String, Shard)> = split.iter().flat_map(|p| p.shards()).collect();
        if let Mlp::Moe(m) = &self.mlp {
            shards.extend(m.shards());
        }
        shards
    }

    fn experts(&self) -> Vec<String> {
        match &self.mlp {
            Mlp::Moe(m) => m.expert_names(),
            Mlp::Dense { .. } => Vec::new(),
        }
    }
}

/// Fails when a mixture of experts meets Megatron's sequence parallelism, which it does not
/// take yet (its output would have to be scattered along the sequence again).
fn whole_mixture(init: &Build, block: &str) -> Result<()> {
    if init.splits_sequence() {
        return Err(Error::Layer {
            layer: block.into(),
            msg: "a mixture of experts does not run under --sequence-parallel yet: drop it \
                  (tensor, context and expert parallelism all apply)"
                .into(),
        });
    }
    Ok(())
}
