//! A profile from a model description, without running it: a GPT-shaped transformer's
//! FLOPs, parameters and activation bytes per layer from its shapes, turned into seconds by a
//! [`Hardware`] description (products at `peak x efficiency`, element-wise work at the memory
//! bandwidth). This is how the planner sizes models that do not fit this machine.

use serde::{Deserialize, Serialize};

use super::hardware::Hardware;
use super::profile::{AttentionShape, Fit, LayerProfile, Profile};
use crate::{invalid, Result};

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
        for (name, v) in [
            ("n_layer", self.n_layer),
            ("d_model", self.d_model),
            ("n_head", self.n_head),
            ("vocab", self.vocab),
            ("seq", self.seq),
        ] {
            if v == 0 {
                return Err(invalid!("the transformer's {name} must be positive"));
            }
        }
        if !self.d_model.is_multiple_of(self.n_head) {
            return Err(invalid!(
                "d_model {} is not divisible by n_head {}",
                self.d_model,
                self.n_head
            ));
        }
        if dtype_bytes != 2 && dtype_bytes != 4 {
            return Err(invalid!(
                "dtype_bytes is 2 (bf16, f16) or 4 (f32), not {dtype_bytes}"
            ));
        }
        let (h, v, s) = (self.d_model as f64, self.vocab as f64, self.seq as f64);
        let q = dtype_bytes as f64;
        let flops_per_s = hw.peak_flops(dtype_bytes == 2) * hw.efficiency;
        let bw = hw.memory_bandwidth_bytes_per_s;
        // Forward seconds per sample: the products, then the element-wise passes (about three
        // reads and writes of what the layer keeps); the backward does twice both. Per token,
        // `kept` and `kept_whole` in hidden-size units, `deferred` in elements.
        let layer =
            |name: String, params: f64, flops: f64, kept: f64, kept_whole: f64, deferred: f64| {
                let (kept, kept_whole) = (kept * s * h * q, kept_whole * s * h * q);
                let all_reduces = if name.starts_with("h.") { 2.0 } else { 1.0 };
                let fwd = flops / flops_per_s + 3.0 * kept / bw;
                LayerProfile {
                    name,
                    params: params as u64,
                    tp_split: true,
                    forward: Fit {
                        fixed_s: 0.0,
                        per_sample_s: fwd,
                    },
                    backward: Fit {
                        fixed_s: 0.0,
                        per_sample_s: 2.0 * fwd,
                    },
                    backward_input: None,
                    backward_weight: None,
                    output_bytes_per_sample: s * h * q,
                    kept_bytes_per_sample: kept,
                    kept_whole_bytes_per_sample: kept_whole,
                    deferred_bytes_per_sample: deferred * s * q,
                    // Megatron's two all-reduces of the hidden state per block (one in the
                    // embedding and in the head).
                    tp_all_reduce_bytes_per_sample: all_reduces * s * h * q,
                    split: Vec::new(),
                    measured: Vec::new(),
                    attention: None,
                }
            };
        let mut layers = vec![layer("embedding".into(), v * h + s * h, 0.0, 1.0, 1.0, h)];
        for i in 0..self.n_layer {
            // q|k|v, the projection and the MLP (24 s h^2) and the causal attention's two
            // products over the lower triangle (2 s^2 h); kept: the input, both norms, the
            // projection and MLP outputs and the residual sum whole (6 h per token), q|k|v, the
            // attention output and the MLP's hidden layer split (8 h); the split backward
            // holds the four products' output gradients (9 h).
            let mut block = layer(
                format!("h.{i}"),
                12.0 * h * h + 13.0 * h,
                24.0 * s * h * h + 2.0 * s * s * h,
                14.0,
                6.0,
                9.0 * h,
            );
            block.attention = Some(AttentionShape {
                heads: self.n_head,
                kv_heads: self.n_head,
                head_dim: self.d_model / self.n_head,
                seq: self.seq,
            });
            layers.push(block);
        }
        // The final norm and the head (tied to the embedding, so a separate stage holds a
        // copy): logits kept for the cross-entropy, split over the vocabulary.
        layers.push(layer(
            "head".into(),
            v * h + 2.0 * h,
            2.0 * s * h * v,
            2.0 + v / h,
            2.0,
            v,
        ));
        let n = layers.len();
        Ok(Profile {
            source: format!("shapes on {}", hw.name),
            dtype_bytes,
            layers,
            bounds: (0..=n).collect(),
            tp_divides: vec![self.n_head],
            // The peak is the whole device's.
            threads: hw.cores_per_device,
        })
    }
}
