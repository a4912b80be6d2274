//! The mixtures of experts in Hugging Face's form: `config.json` of a `MixtralForCausalLM`
//! (every block a mixture, renormalised top k, Mixtral's names) and of a
//! `Qwen3MoeForCausalLM` (every `decoder_sparse_step`-th block a mixture, top k renormalised
//! when `norm_topk_prob` says so, per-head query/key norms, heads of their own width), read
//! into a [`LlamaConfig`] with its [`MoeConfig`] and written back ([`crate::hf`] calls both).

use std::path::Path;

use pipewright::{invalid, Result};

use crate::moe::{MoeConfig, MoeNames};
use crate::LlamaConfig;

/// `c`'s integer `k` (of the file at `path`).
fn int(c: &serde_json::Value, path: &Path, k: &str) -> Result<usize> {
    c[k].as_u64()
        .map(|v| v as usize)
        .ok_or_else(|| invalid!("`{}` has no integer `{k}`", path.display()))
}

/// Fails when the file at `path` (its `config.json`, `c`) attends over a sliding window
/// shorter than `llama`'s positions, or jitters its router: neither is computed here.
fn check_attention(c: &serde_json::Value, path: &Path, llama: &LlamaConfig) -> Result<()> {
    let window = c["sliding_window"].as_u64().map(|w| w as usize);
    let used = c["use_sliding_window"].as_bool().unwrap_or(true);
    if used && window.is_some_and(|w| w < llama.block_size) {
        return Err(invalid!(
            "`{}`: attention over a sliding window is not computed here",
            path.display()
        ));
    }
    if c["router_jitter_noise"].as_f64().is_some_and(|j| j != 0.0) {
        return Err(invalid!(
            "`{}`: router jitter noise is not computed here: set it to 0",
            path.display()
        ));
    }
    Ok(())
}

/// The Llama `llama` (read from a Mixtral's `config.json`, `c`, at `path`) with its blocks
/// mixtures of experts as the file says.
pub(crate) fn mixtral(
    c: &serde_json::Value,
    path: &Path,
    llama: LlamaConfig,
) -> Result<LlamaConfig> {
    check_attention(c, path, &llama)?;
    Ok(LlamaConfig {
        moe: Some(MoeConfig {
            n_experts: int(c, path, "num_local_experts")?,
            top_k: int(c, path, "num_experts_per_tok")?,
            moe_hidden: llama.hidden,
            shared_experts: 0,
            norm_topk: true,
            aux_loss_coef: c["router_aux_loss_coef"].as_f64().unwrap_or(0.02),
            names: MoeNames::Mixtral,
            moe_every: 1,
        }),
        ..llama
    })
}

/// The Llama `llama` (read from a Qwen3-MoE's `config.json`, `c`, at `path`: its dense
/// blocks `intermediate_size` wide) with per-head query/key norms and every
/// `decoder_sparse_step`-th block a mixture of experts.
pub(crate) fn qwen3_moe(
    c: &serde_json::Value,
    path: &Path,
    llama: LlamaConfig,
) -> Result<LlamaConfig> {
    check_attention(c, path, &llama)?;
    if c["mlp_only_layers"]
        .as_array()
        .is_some_and(|l| !l.is_empty())
    {
        return Err(invalid!(
            "`{}`: mlp_only_layers (dense blocks named one by one) is not computed here; \
             every decoder_sparse_step-th block is a mixture",
            path.display()
        ));
    }
    Ok(LlamaConfig {
        qk_norm: true,
        moe: Some(MoeConfig {
            // transformers 5 writes `num_local_experts`, 4 `num_experts`.
            n_experts: int(c, path, "num_experts")
                .or_else(|_| int(c, path, "num_local_experts"))?,
            top_k: int(c, path, "num_experts_per_tok")?,
            moe_hidden: int(c, path, "moe_intermediate_size")?,
            shared_experts: 0,
            norm_topk: c["norm_topk_prob"].as_bool().unwrap_or(false),
            aux_loss_coef: c["router_aux_loss_coef"].as_f64().unwrap_or(0.001),
            names: MoeNames::Qwen3Moe,
            moe_every: c["decoder_sparse_step"].as_u64().unwrap_or(1) as usize,
        }),
        ..llama
    })
}

/// The Hugging Face model that describes the mixture `m` of the Llama `cfg`: Mixtral's (a
/// mixture in every block, renormalised top k, no per-head norms) or Qwen3-MoE's (per-head
/// query/key norms), by the names the mixture takes; none with shared experts.
pub(crate) fn hf_form(cfg: &LlamaConfig, m: &MoeConfig) -> Option<MoeNames> {
    match m.names {
        _ if m.shared_experts > 0 => None,
        MoeNames::Mixtral
            if m.moe_every == 1 && m.norm_topk && !cfg.qk_norm && cfg.head_dim.is_none() =>
        {
            Some(MoeNames::Mixtral)
        }
        MoeNames::Qwen3Moe if cfg.qk_norm => Some(MoeNames::Qwen3Moe),
        _ => None,
    }
}

/// Makes `c` (a `LlamaForCausalLM`'s `config.json` for `cfg`) the config of the model that
/// describes the mixture `m` ([`hf_form`]): a `MixtralForCausalLM` or a
/// `Qwen3MoeForCausalLM`; an error for a mixture neither describes.
pub(crate) fn write_config(
    c: &mut serde_json::Value,
    cfg: &LlamaConfig,
    m: &MoeConfig,
) -> Result<()> {
    let form = hf_form(cfg, m).ok_or_else(|| {
        invalid!(
            "this mixture of experts has no Hugging Face form (Mixtral: a mixture in every block, \
             renormalised top k; Qwen3-MoE: per-head query/key norms; neither with shared \
             experts): export it as safetensors"
        )
    })?;
    let o = c.as_object_mut().expect("an object");
    for k in ["attention_bias", "mlp_bias", "head_dim"] {
        o.remove(k);
    }
    o.insert("num_experts_per_tok".into(), m.top_k.into());
    o.insert("router_aux_loss_coef".into(), m.aux_loss_coef.into());
    o.insert("sliding_window".into(), serde_json::Value::Null);
    match form {
        MoeNames::Mixtral => {
            o.insert(
                "architectures".into(),
                serde_json::json!(["MixtralForCausalLM"]),
            );
            o.insert("model_type".into(), "mixtral".into());
            o.insert("intermediate_size".into(), m.moe_hidden.into());
            o.insert("num_local_experts".into(), m.n_experts.into());
            o.insert("router_jitter_noise".into(), 0.0.into());
        }
        MoeNames::Qwen3Moe => {
            o.insert(
                "architectures".into(),
                serde_json::json!(["Qwen3MoeForCausalLM"]),
            );
            o.insert("model_type".into(), "qwen3_moe".into());
            o.insert("head_dim".into(), cfg.head_dim().into());
            o.insert("attention_bias".into(), false.into());
            o.insert("use_sliding_window".into(), false.into());
            o.insert("moe_intermediate_size".into(), m.moe_hidden.into());
            o.insert("num_experts".into(), m.n_experts.into());
            o.insert("num_local_experts".into(), m.n_experts.into());
            o.insert("norm_topk_prob".into(), m.norm_topk.into());
            o.insert("decoder_sparse_step".into(), m.moe_every.into());
            o.insert("mlp_only_layers".into(), serde_json::json!([]));
        }
    }
    Ok(())
}
