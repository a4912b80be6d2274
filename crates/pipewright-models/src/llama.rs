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
use pipewright::model::nn::{join, rope, scaled_softmax, swiglu, with_aux_loss, Module, RmsNorm};
use pipewright::model::{Activation, Cx, Layer, LayerSpec, Sequential, Shard};
use pipewright::parallel::context_parallel::{ring_attention, Chunks};
use pipewright::parallel::tensor_parallel::{
    Group, ParallelDim, ParallelEmbedding, ParallelLinear, SequenceParallel,
};
use pipewright::trainer::model_spec::ModelSpec;
use pipewright::{invalid, Build, Error, Result};
use serde::{Deserialize, Serialize};

use crate::gpt::{window, LmHead};
use crate::linear::linear;
use crate::moe::{MoeConfig, MoeMlp};

/// A Llama's sizes (Hugging Face's `LlamaConfig` names in the comments).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Tokens (`vocab_size`).
    pub vocab_size: usize,
    /// Longest sequence (`max_position_embeddings`).
    pub block_size: usize,
    /// Blocks (`num_hidden_layers`).
    pub n_layer: usize,
    /// Query heads (`num_attention_heads`).
    pub n_head: usize,
    /// Key and value heads (`num_key_value_heads`; a divisor of `n_head`).
    pub n_kv_head: usize,
    /// Model width (`hidden_size`).
    pub dim: usize,
    /// MLP width (`intermediate_size`).
    pub hidden: usize,
    /// RMSNorm's epsilon (`rms_norm_eps`).
    pub norm_eps: f64,
    /// Rotary base (`rope_theta`).
    pub rope_theta: f64,
    /// Mixtures of experts in place of the MLP of the blocks it says (Mixtral, Qwen3-MoE);
    /// none for a dense Llama (and in runs recorded before there were any).
    #[serde(default)]
    pub moe: Option<MoeConfig>,
}

impl LlamaConfig {
    /// A Llama of these sizes, the rest by the family's defaults: as many key/value heads as
    /// query heads, SwiGLU's MLP width ([`LlamaConfig::swiglu_hidden`]), RMSNorm's epsilon
    /// 1e-5 and rotary base 10000 (Meta's Llama 2).
    pub const fn new(
        vocab_size: usize,
        block_size: usize,
        n_layer: usize,
        n_head: usize,
        dim: usize,
    ) -> Self {
        Self {
            vocab_size,
            block_size,
            n_layer,
            n_head,
            n_kv_head: n_head,
            dim,
            hidden: Self::swiglu_hidden(dim),
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            moe: None,
        }
    }

    /// The Llama a run gets when it names no size (`pipewright train --model llama`): the
    /// small GPT's blocks, heads and width ([`crate::GptConfig::small`]), the rest by
    /// [`LlamaConfig::new`].
    pub const fn small(vocab_size: usize, block_size: usize) -> Self {
        let g = crate::GptConfig::small(vocab_size, block_size);
        Self::new(vocab_size, block_size, g.n_layer, g.n_head, g.n_embd)
    }

    /// SwiGLU's MLP width for a model `dim` wide: 8/3 of it (the width that gives three
    /// matrices the parameters of a 4x GELU MLP's two), rounded up to a multiple of 8 (Meta
    /// rounds to 256, which would more than double a small model's MLP).
    pub const fn swiglu_hidden(dim: usize) -> usize {
        (8 * dim / 3).div_ceil(8) * 8
    }

    /// Fails on sizes that do not make a Llama.
    pub fn validate(&self) -> Result<()> {
        let c = self;
        if [
            c.vocab_size,
            c.block_size,
            c.n_layer,
            c.n_head,
            c.n_kv_head,
            c.dim,
            c.hidden,
        ]
        .contains(&0)
        {
            return Err(invalid!("every Llama size must be positive: {c:?}"));
        }
        if !c.dim.is_multiple_of(c.n_head) || !(c.dim / c.n_head).is_multiple_of(2) {
            return Err(invalid!(
                "dim {} must be n_head {} heads of an even width (rotary pairs)",
                c.dim,
                c.n_head
            ));
        }
        if !c.n_head.is_multiple_of(c.n_kv_head) {
            return Err(invalid!(
                "n_head {} must be a multiple of n_kv_head {} (query heads per key/value group)",
                c.n_head,
                c.n_kv_head
            ));
        }
        if !(c.norm_eps > 0.0 && c.rope_theta > 0.0) {
            return Err(invalid!("norm_eps and rope_theta must be positive"));
        }
        c.moe.as_ref().map_or(Ok(()), MoeConfig::validate)
    }

    /// Parameters of the whole model: the embedding and the head, per block the attention
    /// (q and o of `dim` x `n_head * head_dim`, k and v of the key/value heads), the MLP (three
    /// matrices of `dim` x `hidden`) and two norms, and the final norm.
    pub fn param_count(&self) -> u64 {
        // In f64, exact below 2^53 and saturating above (sizes a user gives may be absurd).
        let (v, d, h) = (self.vocab_size as f64, self.dim as f64, self.hidden as f64);
        let kv = self.n_kv_head as f64 * (self.dim / self.n_head.max(1)) as f64;
        let block = (2.0 * d * d + 2.0 * d * kv + 3.0 * d * h + 2.0 * d) * self.n_layer as f64;
        // A mixture's router and experts in place of a block's dense MLP.
        let moe = self.moe.map_or(0.0, |m| {
            let sparse = (0..self.n_layer).filter(|i| m.at(*i)).count() as f64;
            sparse * (m.param_count(self.dim) as f64 - 3.0 * d * h)
        });
        (2.0 * v * d + block + moe + d).min(u64::MAX as f64) as u64
    }

    fn head_dim(&self) -> usize {
        self.dim / self.n_head
    }
}

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

/// The token embedding (vocabulary-parallel); it refuses sequences past the window, which the
/// rotary positions of the blocks after it cannot know.
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
        window(ids.dim(D::Minus1)?, cx, self.block_size, &self.ring)?;
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
        let q = heads(self.q.forward_gathered(x, cx)?, h)?;
        let k = heads(self.k.forward_gathered(x, cx)?, kvh)?;
        let v = heads(self.v.forward_gathered(x, cx)?, kvh)?;
        let theta = self.cfg.rope_theta;
        if self.ring.size() > 1 {
            return self.ring_attention(&q, &k, &v, cx);
        }
        let (q, k) = (rope(&q, past, theta)?, rope(&k, past, theta)?);
        // Decoding: the cache keeps the key/value heads (not repeated: GQA's saving), and the
        // new queries attend over every cached key too.
        let (k, v) = match &cx.kv_cache {
            Some(cache) => cache.append(&self.name, &k, &v)?,
            None => (k, v),
        };
        let keys = k.dim(2)?;
        // Each key/value head serves `rep` query heads in a row.
        let rep = h / kvh;
        let repeat = |y: Tensor| -> Result<Tensor> {
            if rep == 1 {
                return Ok(y);
            }
            Ok(y.unsqueeze(2)?
                .broadcast_as((b, kvh, rep, keys, hd))?
                .reshape((b, h, keys, hd))?)
        };
        let (k, v) = (repeat(k)?, repeat(v)?);
        let att = scaled_softmax(&q.matmul(&k.t()?)?, 1.0 / (hd as f64).sqrt(), true)?;
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
