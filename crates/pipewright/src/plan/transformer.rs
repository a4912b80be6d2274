//! A profile from a model description, without running it: a GPT-shaped transformer's
//! products, element-wise passes, parameters and activation bytes per layer from its shapes
//! ([`LayerShapes`]), turned into seconds by a [`Hardware`] description (each product on the
//! device's curve for its shape, element-wise work at the memory bandwidth). This is how the
//! planner sizes models that do not fit this machine.

use serde::{Deserialize, Serialize};

use super::hardware::Hardware;
use super::profile::{AttentionShape, Profile};
use super::shaped::{ModelShapes, ShapedLayer};
use super::shapes::{AttentionKernel, LayerShapes, Linear, TpSplit};
use crate::Result;

/// A GPT-2/GPT-3-shaped decoder (the layers of `pipewright_models::gpt`: the embeddings, the
/// blocks, then the final norm with the tied head and the cross-entropy).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Transformer {
    /// Transformer blocks.
    pub n_layer: usize,
    /// Hidden size (`n_embd`).
    pub d_model: usize,
    /// Attention heads.
    pub n_head: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Tokens per sample (the sequence length).
    pub seq: usize,
    /// How attention computes its scores (pipewright's fused kernel by default).
    #[serde(default)]
    pub attention: AttentionKernel,
}

impl Transformer {
    /// GPT-3 175B's shapes (Brown et al. 2020, table 2.1).
    pub fn gpt3_175b() -> Self {
        Self {
            n_layer: 96,
            d_model: 12288,
            n_head: 96,
            vocab: 50257,
            seq: 2048,
            attention: AttentionKernel::Fused,
        }
    }

    /// Parameters of the whole model (the tied head counted once).
    pub fn params(&self) -> u64 {
        let (h, v, s) = (self.d_model as u64, self.vocab as u64, self.seq as u64);
        v * h + s * h + self.n_layer as u64 * (12 * h * h + 13 * h) + 2 * h
    }

    /// The profile of every layer computing in `dtype_bytes`-byte elements (2: bf16/f16 on
    /// the half-precision peak; 4: f32) on `hw`.
    pub fn profile(&self, hw: &Hardware, dtype_bytes: usize) -> Result<Profile> {
        self.shapes()?.profile(hw, dtype_bytes)
    }

    /// The model by its shapes: the embedding, `n_layer` blocks `h.0` .. and the head.
    pub fn shapes(&self) -> Result<ModelShapes> {
        crate::Error::require_positive(
            "the transformer's",
            &[
                ("n_layer", self.n_layer),
                ("d_model", self.d_model),
                ("n_head", self.n_head),
                ("vocab", self.vocab),
                ("seq", self.seq),
            ],
        )?;
        crate::Error::require_multiple(
            "the transformer's",
            ("d_model", self.d_model),
            ("n_head", self.n_head),
        )?;
        let (h, v, s) = (self.d_model as f64, self.vocab as f64, self.seq as f64);
        let (d, vocab, seq) = (self.d_model, self.vocab, self.seq);
        // Per token: `kept` and `kept_whole` in hidden-size units, `deferred` and element-wise
        // passes in elements.
        let unit = |name: &str, count, params, shapes, attention, kept: (f64, f64), deferred| {
            let stack = name == "h";
            ShapedLayer {
                name: name.into(),
                count,
                first: stack.then_some(0),
                params,
                tp_split: true,
                shapes,
                attention,
                output: s * h,
                kept: kept.0 * s * h,
                kept_whole: kept.1 * s * h,
                deferred: deferred * s,
                // Megatron's two all-reduces of the hidden state per block (one in the
                // embedding and in the head).
                tp_all_reduce: if stack { 2.0 } else { 1.0 } * s * h,
                experts: None,
            }
        };
        // The embedding: a gather of token and position rows and their sum.
        let embed = LayerShapes {
            tokens: seq,
            linear: Vec::new(),
            attention: None,
            elementwise_whole_bytes: 4.0 * h,
            elementwise_split_bytes: 0.0,
        };
        // q|k|v (column-parallel), the projection (row-parallel), the MLP's two (column, row);
        // element-wise: two norms and two residual sums whole (10 h per token), the biases,
        // GELU and attention's reshapes over split activations (24 h). Kept: the input, both
        // norms, the projection and MLP outputs and the residual sum whole (6 h per token),
        // q|k|v, the attention output and the MLP's hidden layer split (8 h); the split
        // backward holds the four products' output gradients (9 h).
        let block = LayerShapes {
            tokens: seq,
            linear: vec![
                Linear::new(d, 3 * d, TpSplit::Columns),
                Linear::new(d, d, TpSplit::Rows),
                Linear::new(d, 4 * d, TpSplit::Columns),
                Linear::new(4 * d, d, TpSplit::Rows),
            ],
            attention: Some(self.attention),
            elementwise_whole_bytes: 10.0 * h,
            elementwise_split_bytes: 24.0 * h,
        };
        let attention = Some(AttentionShape {
            heads: self.n_head,
            kv_heads: self.n_head,
            head_dim: self.d_model / self.n_head,
            seq: self.seq,
        });
        // The final norm and the head (tied to the embedding, so a separate stage holds a
        // copy): logits kept for the cross-entropy, split over the vocabulary, which reads
        // and writes them about four times.
        let head = LayerShapes {
            tokens: seq,
            linear: vec![Linear::new(d, vocab, TpSplit::Columns)],
            attention: None,
            elementwise_whole_bytes: 2.0 * h,
            elementwise_split_bytes: 4.0 * v,
        };
        let layers = vec![
            unit("embedding", 1, v * h + s * h, embed, None, (1.0, 1.0), h),
            unit(
                "h",
                self.n_layer,
                12.0 * h * h + 13.0 * h,
                block,
                attention,
                (14.0, 6.0),
                9.0 * h,
            ),
            unit(
                "head",
                1,
                v * h + 2.0 * h,
                head,
                None,
                (2.0 + v / h, 2.0),
                v,
            ),
        ];
        Ok(ModelShapes {
            what: format!("this GPT ({} parameters)", self.params()),
            layers,
            tp_divides: vec![self.n_head],
        })
    }
}
