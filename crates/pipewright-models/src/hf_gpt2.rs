//! The GPT in Hugging Face's GPT-2 form: its parameter names (`transformer.h.0.attn.c_attn.weight`)
//! and `config.json`, so that `GPT2LMHeadModel.from_pretrained` loads what pipewright trained.
//! The GPT's names are GPT-2's already, without the `transformer.` prefix; its vocabulary may
//! be padded (for tensor parallelism), which the export cuts back to the data's.

use std::path::Path;

use pipewright::checkpoint::Reader;
use pipewright::{invalid, Error, Result};

use crate::GptConfig;

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

/// Writes the GPT (`cfg`, the data's `vocab` tokens) of the checkpoint `r` into the directory
/// `out` as `model.safetensors` and `config.json` in Hugging Face's GPT-2 form. Returns how many
/// tensors were written.
pub fn export(r: &Reader, cfg: &GptConfig, vocab: usize, out: &Path) -> Result<usize> {
    if vocab > cfg.vocab_size {
        return Err(invalid!(
            "a vocabulary of {vocab} tokens does not fit the GPT's {}",
            cfg.vocab_size
        ));
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io("cannot create", out, e))?;
    let n = r.export_params(
        &out.join("model.safetensors"),
        |name, t| {
            let t = if name == "wte.weight" || name == "lm_head.weight" {
                t.narrow(0, 0, vocab)?
            } else {
                t
            };
            Ok(Some((hf_name(name), t)))
        },
        Some(serde_json::json!({"format": "pt"})),
    )?;
    let text = serde_json::to_string_pretty(&hf_config(cfg, vocab))
        .map_err(|e| invalid!("cannot write config.json: {e}"))?;
    let cp = out.join("config.json");
    let tmp = cp.with_extension("tmp");
    std::fs::write(&tmp, text).map_err(|e| Error::io("cannot write", &tmp, e))?;
    std::fs::rename(&tmp, &cp).map_err(|e| Error::io("cannot rename into", &cp, e))?;
    Ok(n)
}
