//! GPT-2, exactly: pre-LayerNorm blocks, learned positions, tanh GELU, LayerNorm eps 1e-5, an
//! LM head tied to the token embedding. Parameter names and shapes are Hugging Face GPT-2's
//! (`wte`, `wpe`, `h.N.ln_1`, `h.N.attn.c_attn` stored `(in, out)`, ..., `ln_f`).
//!
//! The tie is two parameters, `wte.weight` (first layer) and `lm_head.weight` (last layer),
//! initialised from the same random stream and kept equal by summing their gradients, so that
//! a first and a last pipeline stage can each own one.
//!
//! Built with a tensor-parallel group in its [`Build`] it is Megatron's GPT: the vocabulary of
//! `wte` and `lm_head` split over the group (rank r's rows of both, so the tie holds shard by
//! shard), attention heads split (`c_attn` column-parallel, `c_proj` row-parallel), the MLP
//! split (`c_fc` column, `c_proj` row), and logits left split for the vocabulary-parallel
//! loss. LayerNorms and `wpe` are whole on every rank.

use candle_core::{DType, Device, Tensor, Var};
use pipewright::model::nn::{join, Dropout, Embedding, LayerNorm, Linear, Module};
use pipewright::model::{Activation, Cx, Layer, LayerSpec, Sequential};
use pipewright::parallel::context_parallel::Chunks;
use pipewright::parallel::tensor_parallel::{
    CausalSelfAttention, ParallelDim, ParallelEmbedding, ParallelLinear, SequenceParallel, Shard,
};
use pipewright::{invalid, Build, Error, Result};
use serde::{Deserialize, Serialize};

/// The tied pair.
pub const TIED: (&str, &str) = ("wte.weight", "lm_head.weight");

/// GPT sizes.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct GptConfig {
    /// Token ids the model reads and predicts (padded to a multiple of the tp size).
    pub vocab_size: usize,
    /// Positions: the longest sequence.
    pub block_size: usize,
    /// Transformer blocks.
    pub n_layer: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Hidden size.
    pub n_embd: usize,
    /// Dropout probability (0 for exact comparisons).
    pub dropout: f64,
}

impl GptConfig {
    /// The GPT a run gets when it names no size (`pipewright train --model gpt`): 2 blocks, 4
    /// heads, 128 wide, no dropout, for `vocab_size` ids in sequences of up to `block_size`.
    pub const fn small(vocab_size: usize, block_size: usize) -> Self {
        Self {
            vocab_size,
            block_size,
            n_layer: 2,
            n_head: 4,
            n_embd: 128,
            dropout: 0.0,
        }
    }

    /// Fails on sizes GPT-2 cannot be built with (heads not dividing the width, ...).
    pub fn validate(&self) -> Result<()> {
        pipewright::Error::require_positive(
            "GPT",
            &[
                ("vocab_size", self.vocab_size),
                ("block_size", self.block_size),
                ("n_layer", self.n_layer),
                ("n_head", self.n_head),
                ("n_embd", self.n_embd),
            ],
        )?;
        pipewright::Error::require_multiple(
            "GPT",
            ("n_embd", self.n_embd),
            ("n_head", self.n_head),
        )?;
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(invalid!("dropout must lie in [0, 1), got {}", self.dropout));
        }
        Ok(())
    }

    /// Parameters of the whole model: embeddings (tokens and positions), per block 12 d^2 +
    /// 13 d (attention, MLP, two norms), the final norm, and the output head (counted apart
    /// from the embedding it is tied to).
    pub fn param_count(&self) -> u64 {
        let (v, p, d, l) = (
            self.vocab_size as u64,
            self.block_size as u64,
            self.n_embd as u64,
            self.n_layer as u64,
        );
        let block = d
            .saturating_mul(d)
            .saturating_mul(12)
            .saturating_add(13 * d);
        v.saturating_mul(2)
            .saturating_add(p)
            .saturating_mul(d)
            .saturating_add(block.saturating_mul(l))
            .saturating_add(2 * d)
    }
}

/// The GPT as a sequential model: `embed`, `h.0` .. `h.{n-1}`, `ln_f`, `lm_head`, with a cut
/// point after the embedding and after every block.
pub fn gpt(cfg: GptConfig) -> Result<Sequential> {
    cfg.validate()?;
    let mut s = Sequential::new();
    s.push(LayerSpec::new("embed", move |init| {
        Ok(Box::new(GptEmbed::new(init, cfg)?) as Box<dyn Layer>)
    }))
    .cut();
    for i in 0..cfg.n_layer {
        let name = format!("h.{i}");
        s.push(LayerSpec::new(name.clone(), move |init| {
            Ok(Box::new(Block::new(init, &name, cfg)?) as Box<dyn Layer>)
        }))
        .cut();
    }
    s.push(LayerSpec::new("ln_f", move |init| {
        Ok(Box::new(Norm(
            LayerNorm::new(init, "ln_f", cfg.n_embd, 1e-5)?,
            SequenceParallel::new(init),
        )) as Box<dyn Layer>)
    }));
    s.push(LayerSpec::new("lm_head", move |init| {
        // Drawn from wte's stream: equal to wte.weight at the start.
        let w = init.normal(TIED.0, &[cfg.vocab_size, cfg.n_embd], 0.02)?;
        let whole = Linear::from_vars(
            "lm_head",
            w,
            None,
            pipewright::model::nn::WeightLayout::OutIn,
        )?;
        // Sequence parallelism ends here: the head gathers the whole sequence.
        Ok(Box::new(LmHead(
            ParallelLinear::from_whole(whole, Some(ParallelDim::Column), 1, &init.tp)?
                .sequence_parallel(init.splits_sequence()),
        )) as Box<dyn Layer>)
    }));
    Ok(s)
}

/// The position of the first of `t` new tokens (after those in the key/value cache), or an
/// error naming the embedding and the flag when they would pass `block_size`: the language
/// models' embeddings check it once per forward. Under context parallelism `t` is this rank's
/// slice and the check is on the whole sequence (`t` times the ring's size).
pub(crate) fn window(t: usize, cx: &Cx, block_size: usize, ring: &Chunks) -> Result<usize> {
    let past = cx.position();
    let t = t * ring.size;
    if past + t > block_size {
        return Err(Error::Layer {
            layer: "embed".into(),
            msg: format!(
                "sequence of {} tokens is longer than block_size {block_size}: raise --block-size",
                past + t
            ),
        });
    }
    Ok(past)
}

/// Token plus position embedding (`wte`, `wpe`), then dropout.
pub struct GptEmbed {
    wte: ParallelEmbedding,
    wpe: Embedding,
    drop: Dropout,
    block_size: usize,
    ring: Chunks,
    sp: SequenceParallel,
}

impl GptEmbed {
    /// The token and position embeddings of `cfg`.
    pub fn new(init: &Build, cfg: GptConfig) -> Result<Self> {
        Ok(Self {
            wte: ParallelEmbedding::new(init, &init.tp, "wte", cfg.vocab_size, cfg.n_embd, 0.02)?,
            wpe: Embedding::new(init, "wpe", cfg.block_size, cfg.n_embd, 0.01)?,
            drop: Dropout::new("drop", cfg.dropout),
            block_size: cfg.block_size,
            ring: Chunks::of(&init.cp),
            sp: SequenceParallel::new(init),
        })
    }
}

impl Layer for GptEmbed {
    fn name(&self) -> &str {
        "embed"
    }

    fn forward(&self, x: Activation, cx: &mut Cx) -> Result<Activation> {
        let ids = x.into_tensor("embed")?;
        let (_, t) = ids.dims2().map_err(|_| Error::Layer {
            layer: "embed".into(),
            msg: format!(
                "expects token ids of shape (batch, time), got {:?}",
                ids.dims()
            ),
        })?;
        let past = window(t, cx, self.block_size, &self.ring)?;
        // Made on the host and uploaded, so that the table's check reads no device copy.
        let pos_host = if self.ring.is_split() {
            // This rank's two chunks of the sequence.
            let [a, z] = self.ring.positions(t);
            let at: Vec<u32> = a.chain(z).map(|p| p as u32).collect();
            Tensor::new(at.as_slice(), &candle_core::Device::Cpu)?
        } else {
            Tensor::arange(past as u32, (past + t) as u32, &candle_core::Device::Cpu)?
        };
        let pos = pos_host.to_device(ids.device())?;
        let x = self
            .wte
            .forward(&ids, cx)?
            .broadcast_add(&self.wpe.forward_with_host(&pos, &pos_host, cx)?)?;
        let x = self.sp.scatter(&x)?;
        Ok(self.sp.dropout(&self.drop, &x, cx)?.into())
    }

    fn params(&self) -> Vec<(String, Var)> {
        let mut v = self.wte.params();
        v.extend(self.wpe.params());
        v
    }

    fn shards(&self) -> Vec<(String, Shard)> {
        self.wte.shards()
    }
}

/// A transformer block: `x + attn(ln_1(x))`, then `x + mlp(ln_2(x))`.
pub struct Block {
    name: String,
    ln_1: LayerNorm,
    attn: CausalSelfAttention,
    ln_2: LayerNorm,
    c_fc: ParallelLinear,
    c_proj: ParallelLinear,
    drop: Dropout,
    sp: SequenceParallel,
}

impl Block {
    /// Block `name` of `cfg`: attention and MLP, each after a LayerNorm and with a residual.
    pub fn new(init: &Build, name: &str, cfg: GptConfig) -> Result<Self> {
        let d = cfg.n_embd;
        let proj_std = 0.02 / (2.0 * cfg.n_layer as f64).sqrt();
        let sp = SequenceParallel::new(init);
        Ok(Self {
            name: name.to_string(),
            ln_1: LayerNorm::new(init, &join(name, "ln_1"), d, 1e-5)?,
            attn: CausalSelfAttention::new(
                init,
                &init.tp,
                &join(name, "attn"),
                d,
                cfg.n_head,
                cfg.dropout,
                proj_std,
            )?
            .on_ring(init.cp.clone())
            .sequence_parallel(sp.clone()),
            ln_2: LayerNorm::new(init, &join(name, "ln_2"), d, 1e-5)?,
            c_fc: ParallelLinear::from_whole(
                Linear::conv1d(init, &join(name, "mlp.c_fc"), d, 4 * d, 0.02)?,
                Some(ParallelDim::Column),
                1,
                &init.tp,
            )?
            .sequence_parallel(sp.is_on()),
            // GELU folded into the second layer (fused on the CPU, never stored).
            c_proj: ParallelLinear::from_whole(
                Linear::conv1d(init, &join(name, "mlp.c_proj"), 4 * d, d, proj_std)?,
                Some(ParallelDim::Row),
                1,
                &init.tp,
            )?
            .input_is_parallel(true)
            .sequence_parallel(sp.is_on())
            .map_local(Linear::gelu_input),
            drop: Dropout::new(&join(name, "mlp.dropout"), cfg.dropout),
            sp,
        })
    }
}

impl Layer for Block {
    fn name(&self) -> &str {
        &self.name
    }

    fn forward(&self, x: Activation, cx: &mut Cx) -> Result<Activation> {
        let x = x.into_tensor(&self.name)?;
        let w = |t: &Tensor| self.sp.weight(t);
        let x = (&x + self.attn.forward(&self.ln_1.forward_with(&x, w)?, cx)?)?;
        let h = self.c_fc.forward(&self.ln_2.forward_with(&x, w)?, cx)?;
        let h = self
            .sp
            .dropout(&self.drop, &self.c_proj.forward(&h, cx)?, cx)?;
        Ok((x + h)?.into())
    }

    fn params(&self) -> Vec<(String, Var)> {
        let mut v = self.ln_1.params();
        v.extend(self.attn.params());
        v.extend(self.ln_2.params());
        v.extend(self.c_fc.params());
        v.extend(self.c_proj.params());
        v
    }

    fn shards(&self) -> Vec<(String, Shard)> {
        let mut v = self.attn.shards();
        v.extend(self.c_fc.shards());
        v.extend(self.c_proj.shards());
        v
    }
}

/// The final LayerNorm as a layer (on this rank's part of the sequence under sequence
/// parallelism).
pub struct Norm(LayerNorm, SequenceParallel);

impl Layer for Norm {
    fn name(&self) -> &str {
        "ln_f"
    }

    fn forward(&self, x: Activation, _cx: &mut Cx) -> Result<Activation> {
        let x = x.into_tensor("ln_f")?;
        Ok(self.0.forward_with(&x, |w| self.1.weight(w))?.into())
    }

    fn params(&self) -> Vec<(String, Var)> {
        self.0.params()
    }
}

/// The language-model head `(vocab, n_embd)`, no bias: logits `(batch, time, vocab)`, or this
/// rank's part of the vocabulary under tensor parallelism (marked split in the [`Cx`]).
pub struct LmHead(ParallelLinear);

impl LmHead {
    /// The head of `linear` (column-parallel over the vocabulary under tensor parallelism).
    pub fn new(linear: ParallelLinear) -> Self {
        Self(linear)
    }
}

impl Layer for LmHead {
    fn name(&self) -> &str {
        "lm_head"
    }

    fn forward(&self, x: Activation, cx: &mut Cx) -> Result<Activation> {
        Ok(self.0.forward(&x.into_tensor("lm_head")?, cx)?.into())
    }

    fn params(&self) -> Vec<(String, Var)> {
        self.0.params()
    }

    fn shards(&self) -> Vec<(String, Shard)> {
        self.0.shards()
    }
}

/// Token ids `(batch, time)` as a u32 tensor.
pub fn ids_tensor(ids: &[u32], batch: usize, device: &Device) -> Result<Tensor> {
    let t = ids.len() / batch.max(1);
    Ok(Tensor::from_vec(ids.to_vec(), (batch, t), device)?.to_dtype(DType::U32)?)
}
