//! A layer's work by shape: its matrix products and the bytes its element-wise passes stream,
//! costed for a micro-batch at a tensor-parallel size, a context-parallel ring and sequence
//! parallelism on a device's [`GemmCurve`] and memory bandwidth. A model planned from its
//! shapes ([`super::Transformer`]) carries these, so a product made thin by tensor
//! parallelism, or attention's narrow per-head products, cost what the device's curve says
//! for their shapes rather than one efficiency for every product.
//!
//! Conventions (per sample, forward; the backward of a product is its two transposed
//! products, the input gradient and the weight gradient; of an element-wise pass, twice its
//! bytes):
//! - A linear product multiplies the sample's tokens (`m`, split over the ring) by an `k x n`
//!   weight; [`TpSplit`] says which side tensor parallelism divides.
//! - Attention: at cp 1 with a fused kernel ([`AttentionKernel::Fused`], pipewright's), the
//!   two products over the causal half, the `seq x seq` scores never in memory; with
//!   materialised scores ([`AttentionKernel::Materialized`], unfused frameworks), both products
//!   whole and the scores' softmax and dropout passes in memory; on a ring of cp, `2 cp + 1`
//!   chunk pairs of `seq / 2cp` tokens each, their scores in memory.

use serde::{Deserialize, Serialize};

use super::attention_rate::causal_work;
use super::gemm::{Gemm, GemmCurve};

/// The shape of a layer's causal self-attention.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AttentionShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention; `heads` for plain multi-head).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Tokens per sample.
    pub seq: usize,
}

/// Which side of a linear product tensor parallelism divides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TpSplit {
    /// Not split (every tp rank computes it whole).
    None,
    /// The outputs (a column-parallel layer).
    Columns,
    /// The inputs (a row-parallel layer).
    Rows,
}

/// A linear layer's product: the tokens times an `inputs x outputs` weight.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Linear {
    /// Input features (`k`).
    pub inputs: usize,
    /// Output features (`n`).
    pub outputs: usize,
    /// What tensor parallelism divides.
    pub split: TpSplit,
}

impl Linear {
    /// The product by an `inputs x outputs` weight that tensor parallelism splits as `split`.
    pub fn new(inputs: usize, outputs: usize, split: TpSplit) -> Self {
        Self {
            inputs,
            outputs,
            split,
        }
    }
}

/// How attention computes its scores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKernel {
    /// A fused kernel: the causal half only, the scores never written to memory
    /// (pipewright's CPU kernel; flash attention).
    #[default]
    Fused,
    /// Scores written to memory, softmax and dropout as passes over them, both products whole
    /// (Megatron-LM before flash attention).
    Materialized,
}

/// What one layer computes per sample.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerShapes {
    /// Tokens per sample.
    pub tokens: usize,
    /// Its linear products.
    pub linear: Vec<Linear>,
    /// Its attention's kernel (the shape is the layer's [`AttentionShape`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention: Option<AttentionKernel>,
    /// Bytes per token its forward's element-wise passes stream that tensor parallelism leaves
    /// whole (norms, residuals; sequence parallelism splits them over tp).
    pub elementwise_whole_bytes: f64,
    /// Bytes per token of element-wise passes over tensor-parallel activations (split by tp).
    pub elementwise_split_bytes: f64,
}

/// Seconds of a micro-batch through a layer, and how much of it each resource bounds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ShapeCost {
    /// Forward seconds.
    pub forward: f64,
    /// Input-gradient seconds (the split backward's first part).
    pub backward_input: f64,
    /// Weight-gradient seconds.
    pub backward_weight: f64,
    /// Of forward and backward, seconds of products bound by the device's ceiling.
    pub compute: f64,
    /// Of forward and backward, seconds bound by memory (thin products, element-wise passes).
    pub memory: f64,
}

impl ShapeCost {
    /// Forward and full backward.
    pub fn total(&self) -> f64 {
        self.forward + self.backward_input + self.backward_weight
    }
}

/// Scores in memory per (row, head, query, key): the softmax reads and writes them, the
/// dropout reads them, writes them and its one-byte mask (in units of an element; the mask
/// counted as half a 2-byte element).
const MATERIALIZED_SCORE_PASSES: f64 = 4.5;

/// Passes of a ring pair's scores through memory (written, exponentiated, summed, read by the
/// second product; [`super::context_parallel::RING_PAIR_TENSORS`] holds five at once in the backward).
const RING_SCORE_PASSES: f64 = 4.0;

/// Where attention's seconds and streamed bytes go.
struct Parts<'a> {
    forward: &'a mut f64,
    backward_input: &'a mut f64,
    streamed: &'a mut f64,
    cost: &'a mut ShapeCost,
}

impl Parts<'_> {
    /// A product of `g` on `curve`, `scale` times, added to `part` (forward or input
    /// gradient) and to the resource that bounds it.
    fn product(&mut self, curve: &GemmCurve, g: Gemm, scale: f64, forward: bool) {
        let s = curve.seconds(&g) * scale;
        if forward {
            *self.forward += s;
        } else {
            *self.backward_input += s;
        }
        if curve.memory_bound(&g) {
            self.cost.memory += s;
        } else {
            self.cost.compute += s;
        }
    }

    /// The scores and values products forward, and twice each in the input gradient.
    fn both_products(&mut self, curve: &GemmCurve, scores: Gemm, values: Gemm) {
        self.product(curve, scores, 1.0, true);
        self.product(curve, values, 1.0, true);
        self.product(curve, scores, 2.0, false);
        self.product(curve, values, 2.0, false);
    }
}

/// Attention `a` computed by `kernel` for a micro-batch of `rows` at tp `tp` on a ring of
/// `cp`, its seconds and streamed bytes added to `p`.
fn attention_cost(
    a: &AttentionShape,
    kernel: AttentionKernel,
    curve: &GemmCurve,
    rows: usize,
    tp: usize,
    cp: usize,
    p: &mut Parts,
) {
    let q = curve.dtype_bytes as f64;
    let heads = a.heads.div_ceil(tp).max(1);
    let d = a.head_dim;
    let pair = |m: usize, batch: usize| {
        let scores = Gemm {
            m,
            n: m,
            k: d,
            batch,
        };
        let values = Gemm {
            m,
            n: d,
            k: m,
            batch,
        };
        (scores, values)
    };
    if cp > 1 {
        // 2cp + 1 chunk pairs per rank, their scores in memory (the ring works in f32).
        let ch = a.seq.div_ceil(2 * cp);
        let batch = rows * heads * (2 * cp + 1);
        let (scores, values) = pair(ch, batch);
        p.both_products(curve, scores, values);
        *p.streamed += RING_SCORE_PASSES * (batch * ch * ch) as f64 * 4.0;
        return;
    }
    let batch = rows * heads;
    let (scores, values) = pair(a.seq, batch);
    match kernel {
        AttentionKernel::Fused => {
            if let Some(rate) = curve.attention.as_ref() {
                // The device's own kernel, at its measured rate.
                let f = curve.overhead_s + rate.forward_seconds(batch, a.seq, d);
                let b = curve.overhead_s + rate.backward_seconds(batch, a.seq, d);
                *p.forward += f;
                *p.backward_input += b;
                p.cost.compute += f + b;
                return;
            }
            // Half the products' work; reads q, k, v, writes the output.
            let work = (scores.flops() + values.flops()) / 2.0;
            let bytes = 4.0 * (batch * a.seq * d) as f64 * q;
            let (s, bound_by_memory) = curve.roofline(work, bytes);
            *p.forward += s;
            *p.backward_input += 2.0 * s;
            if bound_by_memory {
                p.cost.memory += 3.0 * s;
            } else {
                p.cost.compute += 3.0 * s;
            }
        }
        AttentionKernel::Materialized => {
            p.both_products(curve, scores, values);
            *p.streamed += MATERIALIZED_SCORE_PASSES * (batch * a.seq * a.seq) as f64 * q;
        }
    }
}

impl LayerShapes {
    /// Forward FLOPs per sample at tp 1, cp 1, attention's products over the causal half (the
    /// work the model needs, whatever a kernel computes and masks: the model FLOPs of MFU).
    pub fn flops_per_sample(&self, attention: Option<&AttentionShape>) -> f64 {
        let t = self.tokens as f64;
        let linear: f64 = self
            .linear
            .iter()
            .map(|l| 2.0 * t * l.inputs as f64 * l.outputs as f64)
            .sum();
        let attn = attention.map_or(0.0, |a| causal_work(a.heads, a.seq, a.head_dim));
        linear + attn
    }

    /// One micro-batch of `rows` at tensor-parallel size `tp` (sequence parallelism `sp`) on a
    /// ring of `cp`, on a device of `curve` streaming element-wise work at `bandwidth`.
    #[allow(clippy::too_many_arguments)]
    pub fn cost(
        &self,
        attention: Option<&AttentionShape>,
        curve: &GemmCurve,
        bandwidth: f64,
        rows: usize,
        tp: usize,
        cp: usize,
        sp: bool,
    ) -> ShapeCost {
        let (tp, cp) = (tp.max(1), cp.max(1));
        let mut c = ShapeCost::default();
        let mut product = |g: Gemm, scale: f64, part: &mut f64| {
            let s = curve.seconds(&g) * scale;
            *part += s;
            if curve.memory_bound(&g) {
                c.memory += s;
            } else {
                c.compute += s;
            }
        };
        let tokens = (rows * self.tokens).div_ceil(cp).max(1);
        let (mut fwd, mut bwd_in, mut bwd_w) = (0.0, 0.0, 0.0);
        for l in &self.linear {
            let (n, k) = match l.split {
                TpSplit::None => (l.outputs, l.inputs),
                TpSplit::Columns => (l.outputs.div_ceil(tp), l.inputs),
                TpSplit::Rows => (l.outputs, l.inputs.div_ceil(tp)),
            };
            product(Gemm::new(tokens, n, k), 1.0, &mut fwd);
            product(Gemm::new(tokens, k, n), 1.0, &mut bwd_in);
            product(Gemm::new(k, n, tokens), 1.0, &mut bwd_w);
        }
        let mut streamed = 0.0;
        if let (Some(a), Some(kernel)) = (attention, self.attention) {
            let mut parts = Parts {
                forward: &mut fwd,
                backward_input: &mut bwd_in,
                streamed: &mut streamed,
                cost: &mut c,
            };
            attention_cost(a, kernel, curve, rows, tp, cp, &mut parts);
        }
        let whole = self.elementwise_whole_bytes / if sp { tp as f64 } else { 1.0 };
        streamed += tokens as f64 * (whole + self.elementwise_split_bytes / tp as f64);
        let pass = streamed / bandwidth;
        c.memory += 3.0 * pass;
        c.forward = fwd + pass;
        c.backward_input = bwd_in + pass;
        c.backward_weight = bwd_w + pass;
        c
    }
}
