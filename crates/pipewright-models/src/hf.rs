//! The reference models in Hugging Face's form: GPT-2 (`GPT2LMHeadModel`), Llama
//! (`LlamaForCausalLM`), Mixtral and Qwen3-MoE (`MixtralForCausalLM`, `Qwen3MoeForCausalLM`:
//! Llamas whose blocks are mixtures of experts, read and written by `hf_moe.rs`). Their parameter names (the GPT's are GPT-2's without the `transformer.` prefix;
//! the Llama's and Mixtral's are Hugging Face's own, experts under the Hub's per-expert names),
//! their `config.json` read ([`config_from_dir`]: `--init-from`) and written ([`export`]:
//! `ckpt export --format hf-gpt2`, `hf-llama`, `hf-mixtral` or `hf-qwen3-moe`). A vocabulary padded for tensor parallelism is cut back to the data's on the
//! way out.

use std::path::Path;

use pipewright::engine::checkpoint::Reader;
use pipewright::{invalid, Error, Result};

use crate::{GptConfig, LlamaConfig, ModelConfig};

/// Hugging Face's name of the GPT parameter `name`.
pub fn hf_name(name: &str) -> String {
    if name == "lm_head.weight" {
        name.to_string()
    } else {
        format!("transformer.{name}")
    }
}

/// `config.json` of a `GPT2LMHeadModel` with `cfg`'s sizes and a vocabulary of `vocab` tokens.
pub fn hf_config(cfg: &GptConfig, vocab: usize) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": null,
        "activation_function": "gelu_new",
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02,
        "tie_word_embeddings": true,
        "bos_token_id": null,
        "eos_token_id": null,
        "torch_dtype": "float32",
    })
}

/// `config.json` of a `LlamaForCausalLM` with `cfg`'s sizes and a vocabulary of `vocab` tokens
/// (a `MixtralForCausalLM` when its blocks are mixtures of experts).
pub fn llama_config(cfg: &LlamaConfig, vocab: usize) -> Result<serde_json::Value> {
    let mut c = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "max_position_embeddings": cfg.block_size,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.n_kv_head,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden,
        "head_dim": cfg.dim / cfg.n_head,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "tie_word_embeddings": false,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
    });
    if let Some(m) = &cfg.moe {
        crate::hf_moe::write_config(&mut c, cfg, m)?;
    } else if cfg.qk_norm || cfg.head_dim.is_some() {
        return Err(invalid!(
            "a Llama with per-head query/key norms or its own head width has no \
             LlamaForCausalLM form: export it as safetensors"
        ));
    }
    Ok(c)
}

/// The model a Hugging Face directory's `config.json` describes (GPT-2 or Llama); an error for
/// any other architecture or a variant pipewright does not compute the same way.
pub fn config_from_dir(dir: &Path) -> Result<ModelConfig> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| Error::io("not a Hugging Face model directory: cannot read", &path, e))?;
    let c: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| invalid!("`{}` is not JSON: {e}", path.display()))?;
    let int = |k: &str| -> Result<usize> {
        c[k].as_u64()
            .map(|v| v as usize)
            .ok_or_else(|| invalid!("`{}` has no integer `{k}`", path.display()))
    };
    match c["model_type"].as_str() {
        Some("gpt2") => {
            if c["activation_function"]
                .as_str()
                .is_some_and(|a| a != "gelu_new")
            {
                return Err(invalid!(
                    "`{}`: only GPT-2's gelu_new activation is computed",
                    path.display()
                ));
            }
            let vocab = int("vocab_size")?;
            let gpt = GptConfig {
                vocab_size: vocab,
                block_size: int("n_positions")?,
                n_layer: int("n_layer")?,
                n_head: int("n_head")?,
                n_embd: int("n_embd")?,
                dropout: 0.0,
            };
            gpt.validate()?;
            Ok(ModelConfig::Gpt { gpt, vocab })
        }
        Some(kind @ ("llama" | "mixtral" | "qwen3_moe")) => {
            let flag = |k: &str| c[k].as_bool().unwrap_or(false);
            if flag("attention_bias") || flag("mlp_bias") || flag("tie_word_embeddings") {
                return Err(invalid!(
                    "`{}`: a Llama with biases or a tied head is not computed here",
                    path.display()
                ));
            }
            if c["hidden_act"].as_str().is_some_and(|a| a != "silu") {
                return Err(invalid!(
                    "`{}`: only the silu (SwiGLU) MLP is computed",
                    path.display()
                ));
            }
            let n_head = int("num_attention_heads")?;
            let dim = int("hidden_size")?;
            // Only Qwen3's heads may be wider or narrower than hidden_size / heads.
            let head_dim = c["head_dim"]
                .as_u64()
                .map(|h| h as usize)
                .filter(|h| h * n_head != dim);
            if head_dim.is_some() && kind != "qwen3_moe" {
                return Err(invalid!(
                    "`{}`: head_dim x heads must be hidden_size",
                    path.display()
                ));
            }
            let theta = c["rope_theta"]
                .as_f64()
                .or_else(|| c["rope_parameters"]["rope_theta"].as_f64())
                .unwrap_or(10000.0);
            let vocab = int("vocab_size")?;
            let llama = LlamaConfig {
                vocab_size: vocab,
                block_size: int("max_position_embeddings")?,
                n_layer: int("num_hidden_layers")?,
                n_head,
                n_kv_head: c["num_key_value_heads"]
                    .as_u64()
                    .map_or(n_head, |v| v as usize),
                dim,
                hidden: int("intermediate_size")?,
                norm_eps: c["rms_norm_eps"].as_f64().unwrap_or(1e-6),
                rope_theta: theta,
                moe: None,
                head_dim,
                qk_norm: false,
            };
            let llama = match kind {
                "mixtral" => crate::hf_moe::mixtral(&c, &path, llama)?,
                "qwen3_moe" => crate::hf_moe::qwen3_moe(&c, &path, llama)?,
                _ => llama,
            };
            llama.validate()?;
            Ok(ModelConfig::Llama { llama, vocab })
        }
        other => Err(invalid!(
            "`{}` describes a {} model: --init-from reads GPT-2 (gpt2), Llama (llama), Mixtral \
             (mixtral) and Qwen3-MoE (qwen3_moe)",
            path.display(),
            other.unwrap_or("model of no model_type")
        )),
    }
}

/// Writes the model `model` of the checkpoint `r` into the directory `out` as `model.safetensors`
/// and `config.json` in Hugging Face's form (GPT-2 or Llama), the vocabulary cut back to the
/// data's. Returns how many tensors were written.
pub fn export(r: &Reader, model: &ModelConfig, out: &Path) -> Result<usize> {
    let (config, vocab, padded, embed) = match model {
        ModelConfig::Gpt { gpt, vocab } => {
            (hf_config(gpt, *vocab), *vocab, gpt.vocab_size, "wte.weight")
        }
        ModelConfig::Llama { llama, vocab } => (
            llama_config(llama, *vocab)?,
            *vocab,
            llama.vocab_size,
            "model.embed_tokens.weight",
        ),
        ModelConfig::Cnn { .. } => {
            return Err(invalid!(
                "the CNN has no Hugging Face form: export it as safetensors"
            ))
        }
    };
    if vocab > padded {
        return Err(invalid!(
            "a vocabulary of {vocab} tokens does not fit the model's {padded}"
        ));
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io("cannot create", out, e))?;
    let gpt = matches!(model, ModelConfig::Gpt { .. });
    let n = r.export_params(
        &out.join("model.safetensors"),
        |name, t| {
            let t = if name == embed || name == "lm_head.weight" {
                t.narrow(0, 0, vocab)?
            } else {
                t
            };
            Ok(Some((
                if gpt { hf_name(name) } else { name.to_string() },
                t,
            )))
        },
        Some(serde_json::json!({"format": "pt"})),
    )?;
    let text = serde_json::to_string_pretty(&config)
        .map_err(|e| invalid!("cannot write config.json: {e}"))?;
    pipewright::runtime::files::write_atomic(&out.join("config.json"), text.as_bytes())?;
    Ok(n)
}
