//! [`LlamaConfig`]: a Llama's sizes, their checks and its parameter count.

use pipewright::{invalid, Result};
use serde::{Deserialize, Serialize};

use crate::moe::MoeConfig;

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
    /// Each head's width when it is not `dim / n_head` (Qwen3's `head_dim`: q and o are then
    /// `dim` x `n_head * head_dim`); none: `dim / n_head`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_dim: Option<usize>,
    /// Qwen3's per-head RMSNorm of the queries and keys before the rotary embedding
    /// (`self_attn.q_norm`, `self_attn.k_norm`, each `head_dim` wide).
    #[serde(default)]
    pub qk_norm: bool,
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
            head_dim: None,
            qk_norm: false,
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
        let split = c.head_dim.is_some() || c.dim.is_multiple_of(c.n_head);
        if !split || c.head_dim() == 0 || !c.head_dim().is_multiple_of(2) {
            return Err(invalid!(
                "dim {} must be n_head {} heads of an even width (rotary pairs), or head_dim \
                 {:?} even",
                c.dim,
                c.n_head,
                c.head_dim
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
        if let Some(m) = &c.moe {
            m.validate()?;
            // Block k (from 1) is a mixture when k is a multiple of `every`: past the last
            // block, none is, and the run would train a dense model unsaid.
            if m.moe_every > c.n_layer {
                return Err(invalid!(
                    "--moe-every {} with {} blocks (--n-layer) makes no block a mixture of \
                     experts (every {}th block is one): give --moe-every {} or less, or more \
                     layers",
                    m.moe_every,
                    c.n_layer,
                    m.moe_every,
                    c.n_layer
                ));
            }
        }
        Ok(())
    }

    /// Parameters of the whole model: the embedding and the head, per block the attention
    /// (q and o of `dim` x `n_head * head_dim`, k and v of the key/value heads), the MLP (three
    /// matrices of `dim` x `hidden`) and two norms, and the final norm.
    pub fn param_count(&self) -> u64 {
        // In f64, exact below 2^53 and saturating above (sizes a user gives may be absurd).
        let (v, d, h) = (self.vocab_size as f64, self.dim as f64, self.hidden as f64);
        let hd = self.head_dim() as f64;
        let (q, kv) = (self.n_head as f64 * hd, self.n_kv_head as f64 * hd);
        let norms = 2.0 * d + if self.qk_norm { 2.0 * hd } else { 0.0 };
        let block = (2.0 * d * q + 2.0 * d * kv + 3.0 * d * h + norms) * self.n_layer as f64;
        // A mixture's router and experts in place of a block's dense MLP.
        let moe = self.moe.map_or(0.0, |m| {
            let sparse = (0..self.n_layer).filter(|i| m.at(*i)).count() as f64;
            sparse * (m.param_count(self.dim) as f64 - 3.0 * d * h)
        });
        (2.0 * v * d + block + moe + d).min(u64::MAX as f64) as u64
    }

    /// Each head's width: `head_dim`, else `dim / n_head`.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.dim / self.n_head.max(1))
    }
}
