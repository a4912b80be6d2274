//! The reference models describe themselves ([`ModelSpec`]): how each is built, what tensor
//! parallelism must divide, and its layers by shape for the planner, the memory check and
//! morphing. Shapes per token follow `pipewright::plan::shaped`'s conventions (elements, per
//! sample); the GPT's are the library's [`Transformer`], the Llama's and the CNN's are here.

use pipewright::plan::{
    AttentionKernel, AttentionShape, ExpertShape, LayerShapes, Linear, ModelShapes, ShapedLayer,
    TpSplit, Transformer,
};
use pipewright::trainer::model_spec::ModelSpec;
use pipewright::{invalid, Result, Sequential};

use crate::{cnn, gpt, llama, CnnConfig, GptConfig, LlamaConfig, TIED};

impl ModelSpec for GptConfig {
    fn what(&self) -> String {
        format!("this GPT ({} parameters)", self.param_count())
    }

    fn build(&self) -> Result<Sequential> {
        gpt(*self)
    }

    fn tied(&self) -> Vec<(String, String)> {
        vec![(TIED.0.into(), TIED.1.into())]
    }

    /// The heads and the vocabulary (Megatron splits both).
    fn tp_divides(&self) -> Vec<usize> {
        vec![self.n_head, self.vocab_size]
    }

    /// GPT-2's names: `transformer.` before all but the head, which files usually leave out
    /// (tied to `transformer.wte.weight`).
    fn hf_names(&self, name: &str) -> Vec<String> {
        match name {
            "lm_head.weight" => vec![name.to_string(), "transformer.wte.weight".into()],
            _ => vec![crate::hf::hf_name(name)],
        }
    }

    /// GPT-2's blocks over `block_size` positions (the sample's length is not read: the
    /// planner sizes the model's whole window).
    fn shapes(&self, _sample: &[usize]) -> Result<Option<ModelShapes>> {
        self.validate()?;
        let mut shapes = Transformer {
            n_layer: self.n_layer,
            d_model: self.n_embd,
            n_head: self.n_head,
            vocab: self.vocab_size,
            seq: self.block_size,
            attention: Default::default(),
        }
        .shapes()?;
        shapes.what = self.what();
        shapes.tp_divides = ModelSpec::tp_divides(self);
        Ok(Some(shapes))
    }
}

impl ModelSpec for LlamaConfig {
    fn what(&self) -> String {
        format!("this Llama ({} parameters)", self.param_count())
    }

    fn build(&self) -> Result<Sequential> {
        llama(*self)
    }

    /// Query heads, key/value heads, the MLP width and the vocabulary; 1 with a mixture of
    /// experts (its experts do not split over tensor-parallel ranks yet).
    fn tp_divides(&self) -> Vec<usize> {
        let mut d = vec![self.n_head, self.n_kv_head, self.hidden, self.vocab_size];
        // Each expert splits as an MLP does.
        d.extend(self.moe.map(|m| m.moe_hidden));
        d
    }

    /// The embedding, `n_layer` blocks `model.layers.N` and the final norm with the head, over
    /// `block_size` positions. Attention's scores are in memory (the block's softmax over
    /// `q k^T`), one `seq`-long row per head and token kept for the backward.
    fn shapes(&self, _sample: &[usize]) -> Result<Option<ModelShapes>> {
        self.validate()?;
        let f = |v: usize| v as f64;
        let (d, s) = (f(self.dim), f(self.block_size));
        let (v, hidden) = (f(self.vocab_size), f(self.hidden));
        let hd = self.head_dim();
        let (dq, dkv) = (f(self.n_head * hd), f(self.n_kv_head * hd));
        let seq = self.block_size;
        let unit = |name: &str, count, params, shapes, kept: (f64, f64), deferred, all_reduce| {
            ShapedLayer {
                name: name.into(),
                count,
                first: (name == "model.layers").then_some(0),
                params,
                tp_split: true,
                shapes,
                attention: None,
                output: s * d,
                kept: kept.0 * s,
                kept_whole: kept.1 * s,
                deferred: deferred * s,
                tp_all_reduce: all_reduce * s * d,
                experts: None,
            }
        };
        // A gather of the vocabulary-parallel table's rows (read, written).
        let embed = LayerShapes {
            tokens: seq,
            linear: Vec::new(),
            attention: None,
            elementwise_whole_bytes: 2.0 * d,
            elementwise_split_bytes: 0.0,
        };
        let col = |i, o| Linear::new(i, o, TpSplit::Columns);
        let row = |i, o| Linear::new(i, o, TpSplit::Rows);
        let (dim, qw, kvw, mlp) = (self.dim, self.n_head * hd, self.n_kv_head * hd, self.hidden);
        // Whole: two RMSNorms (read, write: 2 d each) and two residual sums (3 d each). Split:
        // q, k, v made contiguous per head, q and k rotated, the key/value heads repeated for
        // their query heads, the output's transpose, SwiGLU (reads two, writes one).
        let repeat = if self.n_kv_head == self.n_head {
            0.0
        } else {
            4.0 * dq
        };
        let block = LayerShapes {
            tokens: seq,
            linear: vec![
                col(dim, qw),
                col(dim, kvw),
                col(dim, kvw),
                row(qw, dim),
                col(dim, mlp),
                col(dim, mlp),
                row(mlp, dim),
            ],
            attention: Some(AttentionKernel::Materialized),
            elementwise_whole_bytes: 10.0 * d,
            elementwise_split_bytes: 2.0 * (dq + 2.0 * dkv)
                + 2.0 * (dq + dkv)
                + repeat
                + 2.0 * dq
                + 3.0 * hidden,
        };
        // Kept per token: the input, both norms' outputs and the residual sum whole (4 d);
        // q, k, v, the rotated q and k, the attention output, one row of probabilities per
        // head, gate, up and their product split. The split backward holds the seven
        // products' output gradients.
        let kept_split = (dq + 2.0 * dkv) + (dq + dkv) + dq + s * f(self.n_head) + 3.0 * hidden;
        let qk_norm = if self.qk_norm { 2.0 * f(hd) } else { 0.0 };
        let block_params = 2.0 * d * dq + 2.0 * d * dkv + 3.0 * d * hidden + 2.0 * d + qk_norm;
        let head = LayerShapes {
            tokens: seq,
            linear: vec![col(dim, self.vocab_size)],
            attention: None,
            elementwise_whole_bytes: 2.0 * d,
            elementwise_split_bytes: 4.0 * v,
        };
        let mut blocks = unit(
            "model.layers",
            self.n_layer,
            block_params,
            block,
            (4.0 * d + kept_split, 4.0 * d),
            dq + 2.0 * dkv + 2.0 * d + 2.0 * hidden,
            2.0,
        );
        blocks.attention = Some(AttentionShape {
            heads: self.n_head,
            kv_heads: self.n_kv_head,
            head_dim: hd,
            seq,
        });
        let mut layers = vec![unit("embed", 1, v * d, embed, (d, d), d, 1.0)];
        layers.extend(self.with_mixtures(blocks));
        layers.push(unit(
            "head",
            1,
            v * d + d,
            head,
            (2.0 * d + v, 2.0 * d),
            v,
            1.0,
        ));
        Ok(Some(ModelShapes {
            what: self.what(),
            layers,
            tp_divides: ModelSpec::tp_divides(self),
        }))
    }
}

impl LlamaConfig {
    /// The `n_layer` blocks `blocks` describes, each mixture of experts in place of its dense
    /// MLP (one unit per block then): the router and, per token, its `top_k` experts' and the
    /// shared experts' products; every expert's parameters; SwiGLU's passes and what the
    /// backward keeps for each expert a token goes through, and the router's probabilities;
    /// the experts' parameters and the rows the dispatch and combine move (expert
    /// parallelism's split and exchange).
    fn with_mixtures(&self, blocks: ShapedLayer) -> Vec<ShapedLayer> {
        let Some(m) = self.moe else {
            return vec![blocks];
        };
        let (d, h) = (self.dim as f64, self.hidden as f64);
        let s = self.block_size as f64;
        let wide = (m.top_k + m.shared_experts) * m.moe_hidden;
        let whole = |i, o| Linear::new(i, o, TpSplit::None);
        // Each expert splits over tp as an MLP does; the router is whole.
        let (col, row) = (
            |i, o| Linear::new(i, o, TpSplit::Columns),
            |i, o| Linear::new(i, o, TpSplit::Rows),
        );
        (0..self.n_layer)
            .map(|i| {
                let mut u = ShapedLayer {
                    count: 1,
                    first: Some(i),
                    ..blocks.clone()
                };
                if !m.at(i) {
                    return u;
                }
                let dense = 3.0 * h;
                let moe = 3.0 * wide as f64;
                u.params += m.param_count(self.dim) as f64 - 3.0 * d * h;
                u.shapes.linear.truncate(4);
                u.shapes.linear.extend([
                    whole(self.dim, m.n_experts),
                    col(self.dim, wide),
                    col(self.dim, wide),
                    row(wide, self.dim),
                ]);
                u.shapes.elementwise_split_bytes += moe - dense + m.n_experts as f64;
                u.kept += (moe - dense + m.n_experts as f64) * s;
                u.deferred += (2.0 * wide as f64 - 2.0 * h) * s;
                // Attention's output, then each expert's (and the shared experts') output
                // all-reduced over tp.
                let reduces = 1 + m.top_k + usize::from(m.shared_experts > 0);
                u.tp_all_reduce = reduces as f64 * s * d;
                u.experts = Some(ExpertShape {
                    count: m.n_experts,
                    params: (m.n_experts * 3 * self.dim * m.moe_hidden) as f64,
                    // Each token's rows to its top-k experts and back.
                    all_to_all: 2.0 * m.top_k as f64 * s * d,
                });
                u
            })
            .collect()
    }
}

impl ModelSpec for CnnConfig {
    fn what(&self) -> String {
        "this CNN".into()
    }

    fn build(&self) -> Result<Sequential> {
        cnn(*self)
    }

    /// The stem, the residual blocks and the pooled head for images of `[channels, height,
    /// width]`: each convolution a product of the output pixels by its `k x k x in` patches
    /// (implicit GEMM); BatchNorm and ReLU passes over each output map. Nothing splits over
    /// tensor-parallel ranks.
    fn shapes(&self, sample: &[usize]) -> Result<Option<ModelShapes>> {
        self.validate()?;
        let &[channels, height, width] = sample else {
            return Err(invalid!(
                "the CNN is sized for images of [channels, height, width], not {sample:?}"
            ));
        };
        if channels != self.in_channels || height == 0 || width == 0 {
            return Err(invalid!(
                "the CNN reads images of {} channels, not {sample:?}",
                self.in_channels
            ));
        }
        let conv = |inp: usize, out: usize, k: usize| Linear::new(k * k * inp, out, TpSplit::None);
        let stem = vec![conv(channels, self.width, 3)];
        let mut layers = vec![conv_unit("stem", None, 1, height * width, stem, self.width)];
        // Stage by stage: its first block (strided, with a shortcut, past the first stage),
        // then the rest of the stage's blocks, all alike.
        let (mut h, mut w, mut inp) = (height, width, self.width);
        let mut i = 0;
        while i < self.blocks {
            let stage = i / self.blocks_per_stage;
            let out = u32::try_from(stage)
                .ok()
                .and_then(|s| self.width.checked_shl(s))
                .filter(|c| c >> stage.min(63) == self.width && c.checked_mul(9).is_some())
                .ok_or_else(|| {
                    invalid!(
                        "the CNN's channels double {stage} times from {}: past what fits a number; use fewer blocks or more blocks per stage",
                        self.width
                    )
                })?;
            let stride = if out != inp { 2 } else { 1 };
            (h, w) = (h.div_ceil(stride), w.div_ceil(stride));
            let mut first = vec![conv(inp, out, 3), conv(out, out, 3)];
            if stride != 1 {
                first.push(conv(inp, out, 1));
            }
            layers.push(conv_unit("blocks", Some(i), 1, h * w, first, out));
            let rest =
                (self.blocks_per_stage - i % self.blocks_per_stage - 1).min(self.blocks - i - 1);
            if rest > 0 {
                let same = vec![conv(out, out, 3), conv(out, out, 3)];
                layers.push(conv_unit("blocks", Some(i + 1), rest, h * w, same, out));
            }
            i += 1 + rest;
            inp = out;
        }
        layers.push(cnn_head(self, h * w, inp));
        Ok(Some(ModelShapes {
            what: self.what(),
            layers,
            tp_divides: vec![1],
        }))
    }
}

/// `count` units of convolutions `linear` over `pixels` output pixels of `out` channels each
/// (numbered from `first` when a stack). Per convolution and output pixel, pipewright's
/// composed BatchNorm (the batch's mean and variance, then subtract, divide, scale, shift)
/// keeps six maps beside the product's and ReLU's (or the sum's), and its element-wise ops
/// stream about twenty; the product unfolds its `k x k x in` patches (im2col), written and
/// read.
fn conv_unit(
    name: &str,
    first: Option<usize>,
    count: usize,
    pixels: usize,
    linear: Vec<Linear>,
    out: usize,
) -> ShapedLayer {
    let f = |v: usize| v as f64;
    let convs = linear.len() as f64;
    let weights: f64 = linear.iter().map(|l| f(l.inputs) * f(l.outputs)).sum();
    let patches: f64 = linear.iter().map(|l| 2.0 * f(l.inputs)).sum();
    let kept = 8.0 * convs * f(out);
    ShapedLayer {
        name: name.into(),
        count,
        first,
        // Each BatchNorm's scale and shift beside the products' weights.
        params: weights + 2.0 * f(out) * convs,
        tp_split: false,
        shapes: LayerShapes {
            tokens: pixels,
            linear,
            attention: None,
            elementwise_whole_bytes: 20.0 * convs * f(out) + patches,
            elementwise_split_bytes: 0.0,
        },
        attention: None,
        output: f(pixels) * f(out),
        kept: f(pixels) * kept,
        kept_whole: f(pixels) * kept,
        deferred: f(pixels) * f(out),
        tp_all_reduce: 0.0,
        experts: None,
    }
}

/// The CNN's head over `pixels` of the last blocks' `channels`: global average pooling (it
/// reads the last maps), then the classifier (and the long skip's map of the stem's pooled
/// features).
fn cnn_head(cfg: &CnnConfig, pixels: usize, channels: usize) -> ShapedLayer {
    let f = |v: usize| v as f64;
    let mut linear = vec![Linear::new(channels, cfg.classes, TpSplit::None)];
    if cfg.long_skip {
        linear.push(Linear::new(cfg.width, cfg.classes, TpSplit::None));
    }
    // The classifier's bias beside the weights.
    let params = linear
        .iter()
        .map(|l| f(l.inputs) * f(l.outputs))
        .sum::<f64>()
        + f(cfg.classes);
    ShapedLayer {
        name: "head".into(),
        count: 1,
        first: None,
        params,
        tp_split: false,
        shapes: LayerShapes {
            tokens: 1,
            linear,
            attention: None,
            elementwise_whole_bytes: f(pixels * channels),
            elementwise_split_bytes: 0.0,
        },
        attention: None,
        output: f(cfg.classes),
        kept: f(channels + cfg.classes),
        kept_whole: f(channels + cfg.classes),
        deferred: f(cfg.classes),
        tp_all_reduce: 0.0,
        experts: None,
    }
}
