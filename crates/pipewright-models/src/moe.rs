//! A mixture of experts in place of a Llama block's MLP (Mixtral's and Qwen3-MoE's, with
//! DeepSeek's shared experts as an option): a router picks `top_k` of `n_experts` SwiGLU
//! experts for each token and adds their outputs, weighted.
//!
//! - Routing as Mixtral and Qwen3-MoE route: a softmax over all experts (in f32), the top k
//!   taken, their weights renormalised to sum to 1 when `norm_topk` says so (Mixtral always).
//!   Ties go to the lower expert index, so that every layout routes a token the same way.
//! - Dropless dispatch: the tokens' rows are gathered by expert, each expert computes all its
//!   rows as one product, and the weighted results are added back at their tokens (experts in
//!   index order); no token is dropped and there is no capacity to size.
//! - Expert parallelism: built for a rank of an expert-parallel group ([`Build::ep`]), the
//!   mixture holds only that rank's experts (their global names kept) and sends the rows
//!   between the group's ranks ([`pipewright::parallel::expert_parallel::Dispatch`]); the
//!   routing, the weights and the auxiliary loss stay on the token's own rank.
//! - Shared experts (DeepSeek's): `shared` more experts every token goes through, unweighted,
//!   as one SwiGLU `shared * hidden` wide (the same sum).
//! - The load-balancing loss is Switch's, per layer (Hugging Face's `load_balancing_loss_func`
//!   over one layer's router logits): `E * sum_e f_e P_e`, where `f_e` is the number of the
//!   tokens' top-k slots expert `e` took over the number of tokens and `P_e` its mean router
//!   probability; only `P_e` carries a gradient.
//!
//! Parameter names are Hugging Face's: Mixtral's `block_sparse_moe.gate` and
//! `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down); Qwen3-MoE's `mlp.gate` and
//! `mlp.experts.{e}.gate_proj`, `up_proj`, `down_proj`; DeepSeek's `mlp.shared_experts.*`.

use candle_core::{DType, Tensor, Var};
use pipewright::distributed::comm::{Group, ReduceOp};
use pipewright::model::nn::{join, softmax_last_dim, swiglu, Linear, Module};
use pipewright::model::{Cx, Shard};
use pipewright::parallel::expert_parallel::{local_experts, Dispatch};
use pipewright::parallel::tensor_parallel::{copy_to_group, ParallelDim, ParallelLinear};
use pipewright::{invalid, Build, Error, Result};
use serde::{Deserialize, Serialize};

use crate::linear::linear;

/// Whose parameter names the experts take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MoeNames {
    /// Mixtral's: `block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1|w3|w2`.
    Mixtral,
    /// Qwen3-MoE's: `mlp.gate`, `mlp.experts.{e}.gate_proj|up_proj|down_proj`.
    Qwen3Moe,
}

/// A mixture of experts' sizes and rules (Hugging Face's names in the comments).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Routed experts (`num_local_experts`, `num_experts`).
    pub n_experts: usize,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: usize,
    /// One expert's MLP width (`--moe-hidden`; `intermediate_size`, `moe_intermediate_size`).
    #[serde(alias = "hidden")]
    pub moe_hidden: usize,
    /// Shared experts every token goes through (`--shared-experts`; DeepSeek's
    /// `n_shared_experts`; 0: none).
    #[serde(alias = "shared")]
    pub shared_experts: usize,
    /// The top k weights renormalised to sum to 1 (`norm_topk_prob`; Mixtral always).
    pub norm_topk: bool,
    /// The load-balancing loss's weight in the training loss (`--aux-loss-coef`;
    /// `router_aux_loss_coef`).
    #[serde(alias = "aux_coef")]
    pub aux_loss_coef: f64,
    /// Whose parameter names.
    pub names: MoeNames,
    /// Block `i` (from 0) is a mixture when `(i + 1) % every == 0`, the others dense
    /// (`--moe-every`; Qwen's `decoder_sparse_step`; 1: every block).
    #[serde(alias = "every")]
    pub moe_every: usize,
}

impl MoeConfig {
    /// Fails on sizes no mixture can have.
    pub fn validate(&self) -> Result<()> {
        if self.n_experts == 0 || self.top_k == 0 || self.top_k > self.n_experts {
            return Err(invalid!(
                "--top-k {} of --n-experts {}: choose 1 <= top-k <= experts",
                self.top_k,
                self.n_experts
            ));
        }
        if self.moe_every == 0 {
            return Err(invalid!("--moe-every must be at least 1 (1: every block)"));
        }
        if self.moe_hidden == 0 || !self.aux_loss_coef.is_finite() || self.aux_loss_coef < 0.0 {
            return Err(invalid!(
                "an expert needs a positive width (got {}) and the auxiliary loss a \
                 non-negative coefficient (got {})",
                self.moe_hidden,
                self.aux_loss_coef
            ));
        }
        Ok(())
    }

    /// Whether block `layer` (from 0) is a mixture.
    pub fn at(&self, layer: usize) -> bool {
        (layer + 1).is_multiple_of(self.moe_every)
    }

    /// The parameters of one mixture in a model `dim` wide: the router, the experts and the
    /// shared experts.
    pub fn param_count(&self, dim: usize) -> u64 {
        let (d, h) = (dim as f64, self.moe_hidden as f64);
        let experts = (self.n_experts + self.shared_experts) as f64 * 3.0 * d * h;
        (d * self.n_experts as f64 + experts).min(u64::MAX as f64) as u64
    }

    /// The names of block `block`'s router and of expert `e`'s (gate, up, down) products.
    fn names(&self, block: &str, e: usize) -> (String, [String; 3]) {
        match self.names {
            MoeNames::Mixtral => {
                let at = |s: &str| join(block, &format!("block_sparse_moe.{s}"));
                let w = |i: u8| at(&format!("experts.{e}.w{i}"));
                (at("gate"), [w(1), w(3), w(2)])
            }
            MoeNames::Qwen3Moe => {
                let at = |s: &str| join(block, &format!("mlp.{s}"));
                let p = |s: &str| at(&format!("experts.{e}.{s}"));
                (at("gate"), [p("gate_proj"), p("up_proj"), p("down_proj")])
            }
        }
    }
}

/// A SwiGLU MLP, `down(silu(gate(x)) * up(x))`, split over the tensor-parallel group as
/// Megatron splits an MLP: gate and up by output features, down by input features, its
/// partial outputs summed over the group (in a group of one: the plain MLP).
pub struct Expert {
    gate: ParallelLinear,
    up: ParallelLinear,
    down: ParallelLinear,
    tp: Group,
}

impl Expert {
    /// The expert named `[gate, up, down]`, `dim` to `hidden` and back, this rank's part of it.
    pub fn new(init: &Build, [g, u, d]: &[String; 3], dim: usize, hidden: usize) -> Result<Self> {
        let split = |name: &str, inp, out, dim| {
            ParallelLinear::from_whole(linear(init, name, inp, out)?, Some(dim), 1, &init.tp)
        };
        Ok(Self {
            gate: split(g, dim, hidden, ParallelDim::Column)?,
            up: split(u, dim, hidden, ParallelDim::Column)?,
            down: split(d, hidden, dim, ParallelDim::Row)?.input_is_parallel(true),
            tp: init.tp.clone(),
        })
    }

    /// The expert on rows `x` `(rows, dim)`, whole on every rank of the group.
    pub fn forward(&self, x: &Tensor, cx: &mut Cx) -> Result<Tensor> {
        // Into the tensor-parallel region once for gate and up.
        let x = copy_to_group(x, &self.tp)?;
        let h = swiglu(
            &self.gate.forward_gathered(&x, cx)?,
            &self.up.forward_gathered(&x, cx)?,
        )?;
        self.down.forward(&h, cx)
    }

    fn params(&self) -> Vec<(String, Var)> {
        [&self.gate, &self.up, &self.down]
            .iter()
            .flat_map(|l| l.params())
            .collect()
    }

    fn shards(&self) -> Vec<(String, Shard)> {
        [&self.gate, &self.up, &self.down]
            .iter()
            .flat_map(|l| l.shards())
            .collect()
    }
}

/// What one pass of a mixture gave.
pub struct Routed {
    /// The output, the input's shape.
    pub out: Tensor,
    /// The load-balancing loss (a scalar, f32; before its coefficient).
    pub aux: Tensor,
    /// Top-k slots each expert took (tokens per expert, a token counted once per expert).
    pub load: Vec<usize>,
}

/// A block's mixture of experts.
pub struct MoeMlp {
    name: String,
    cfg: MoeConfig,
    router: Linear,
    /// This rank's experts (all of them without expert parallelism).
    experts: Vec<Expert>,
    /// The expert-parallel group the experts are split over.
    ep: Group,
    /// The context-parallel ring the sequences are split over: the routing statistics of
    /// the auxiliary loss are summed over it.
    cp: Group,
    shared: Option<Expert>,
}

impl MoeMlp {
    /// Block `block`'s mixture, for a model `dim` wide (this rank's part of the experts when
    /// `init` is for a rank of an expert-parallel group).
    pub fn new(init: &Build, block: &str, dim: usize, cfg: MoeConfig) -> Result<Self> {
        cfg.validate()?;
        let (router, _) = cfg.names(block, 0);
        let experts = local_experts(cfg.n_experts, init.ep.rank(), init.ep.size())?
            .map(|e| Expert::new(init, &cfg.names(block, e).1, dim, cfg.moe_hidden))
            .collect::<Result<_>>()?;
        let shared = (cfg.shared_experts > 0)
            .then(|| {
                let at = |s: &str| join(block, &format!("mlp.shared_experts.{s}"));
                let names = [at("gate_proj"), at("up_proj"), at("down_proj")];
                Expert::new(init, &names, dim, cfg.shared_experts * cfg.moe_hidden)
            })
            .transpose()?;
        Ok(Self {
            name: join(block, "moe"),
            cfg,
            router: linear(init, &router, dim, cfg.n_experts)?,
            experts,
            ep: init.ep.clone(),
            cp: init.cp.clone(),
            shared,
        })
    }

    /// The mixture on `x` `(..., dim)` in the context `cx`.
    pub fn forward(&self, x: &Tensor, cx: &mut Cx) -> Result<Routed> {
        let dims = x.dims().to_vec();
        let dim = *dims.last().ok_or_else(|| Error::Layer {
            layer: self.name.clone(),
            msg: "expects (..., channels), got a scalar".into(),
        })?;
        let xs = x.reshape(((), dim))?;
        let n = xs.dim(0)?;
        let probs = softmax_last_dim(&self.router.forward(&xs)?.to_dtype(DType::F32)?)?;
        let e = self.cfg.n_experts;
        let idx = top_k(&probs, self.cfg.top_k)?;
        let mut w = probs.gather(&idx, 1)?;
        // The host groups the tokens by expert (the exchange's counts are the host's): it reads
        // the chosen indices, `k` per token, not the `e` probabilities.
        let chosen = idx.to_vec2::<u32>()?;
        if self.cfg.norm_topk {
            w = w.broadcast_div(&w.sum_keepdim(1)?)?;
        }
        let w = w.flatten_all()?.to_dtype(x.dtype())?;
        let groups = by_expert(&chosen, e);
        // Each expert's tokens: a token counted once per expert it goes to.
        let load: Vec<usize> = groups.iter().map(|(rows, _)| rows.len()).collect();
        let (rows, slots): (Vec<u32>, Vec<u32>) =
            groups
                .into_iter()
                .fold((Vec::new(), Vec::new()), |(mut r, mut s), (rows, slots)| {
                    r.extend(rows);
                    s.extend(slots);
                    (r, s)
                });
        let dispatch = Dispatch::new(&load, &self.ep)?;
        let at = Tensor::new(rows.as_slice(), x.device())?;
        let sorted = match rows.len() {
            0 => xs.narrow(0, 0, 0)?,
            _ => xs.index_select(&at, 0)?,
        };
        // Run on every rank of an expert group, rows or none: it exchanges with the others.
        let y = dispatch.run(&sorted, |j, r| self.experts[j].forward(r, cx))?;
        let mut out = xs.zeros_like()?;
        if !rows.is_empty() {
            let ws = w.index_select(&Tensor::new(slots.as_slice(), x.device())?, 0)?;
            out = out.index_add(&at, &y.broadcast_mul(&ws.unsqueeze(1)?)?, 0)?;
        }
        if let Some(s) = &self.shared {
            out = (out + s.forward(&xs, cx)?)?;
        }
        let aux = self.aux(&probs, &load, n)?;
        Ok(Routed {
            out: out.reshape(dims)?,
            aux,
            load,
        })
    }

    /// Switch's load-balancing loss of router probabilities `probs` `(n, E)` whose top-k
    /// slots fell as `load`: `E / n * sum_e load_e * mean_i probs[i, e]`. Under context
    /// parallelism the counts are the whole ring's and this rank's share is its own tokens'
    /// part of the sum (the shares add up to the loss, and so do their gradients).
    fn aux(&self, probs: &Tensor, load: &[usize], n: usize) -> Result<Tensor> {
        let e = self.cfg.n_experts;
        let mut counts: Vec<f32> = load.iter().map(|l| *l as f32).collect();
        counts.push(n as f32);
        let mut counts = Tensor::from_vec(counts, e + 1, &candle_core::Device::Cpu)?;
        if self.cp.size() > 1 {
            counts = self.cp.all_reduce(&counts, ReduceOp::Sum)?;
        }
        let counts = counts.to_vec1::<f32>()?;
        let n = counts[e] as f64;
        if n == 0.0 {
            return Ok(Tensor::zeros((), DType::F32, probs.device())?);
        }
        let f = Tensor::from_slice(&counts[..e], e, probs.device())?;
        let scale = e as f64 / (n * n);
        Ok((probs.sum(0)? * f)?.sum_all()?.affine(scale, 0.0)?)
    }

    /// The load-balancing loss's coefficient.
    pub fn aux_coef(&self) -> f64 {
        self.cfg.aux_loss_coef
    }

    /// The names of this rank's experts' parameters (the router and shared experts are on
    /// every rank).
    pub fn expert_names(&self) -> Vec<String> {
        self.experts
            .iter()
            .flat_map(|x| x.params().into_iter().map(|(n, _)| n))
            .collect()
    }

    /// How this rank's parts of the experts are split over the tensor-parallel group.
    pub fn shards(&self) -> Vec<(String, Shard)> {
        self.experts
            .iter()
            .chain(&self.shared)
            .flat_map(Expert::shards)
            .collect()
    }

    /// The router's and this rank's experts' parameters, in that order.
    pub fn params(&self) -> Vec<(String, Var)> {
        let mut v = self.router.params();
        for x in self.experts.iter().chain(&self.shared) {
            v.extend(x.params());
        }
        v
    }
}

/// Each token's `k` experts by probability (`probs`: `(tokens, experts)`), highest first, as
/// a `(tokens, k)` u32 tensor on `probs`' device: sorted there, nothing read back. Ties go to
/// the lower index on the CPU (a stable sort); a GPU's sort may break an exact tie either way.
pub fn top_k(probs: &Tensor, k: usize) -> Result<Tensor> {
    Ok(probs
        .contiguous()?
        .arg_sort_last_dim(false)?
        .narrow(1, 0, k)?
        .contiguous()?)
}

/// For each expert, the tokens routed to it and their slots (`token * k + j`) in the flat
/// `(tokens, k)` weights, in token order.
fn by_expert(chosen: &[Vec<u32>], e: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
    let mut out = vec![(Vec::new(), Vec::new()); e];
    let k = chosen.first().map_or(0, Vec::len);
    for (i, row) in chosen.iter().enumerate() {
        for (j, c) in row.iter().enumerate() {
            out[*c as usize].0.push(i as u32);
            out[*c as usize].1.push((i * k + j) as u32);
        }
    }
    out
}
