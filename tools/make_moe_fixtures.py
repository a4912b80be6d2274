"""Makes crates/pipewright-models/tests/fixtures/moe-{mixtral,qwen3moe}.safetensors: one sparse
mixture-of-experts block of Hugging Face's MixtralForCausalLM and Qwen3MoeForCausalLM (tiny
sizes, seeded), its weights under the names the Hub's checkpoints use (as `save_pretrained`
writes them), an input `x`, a cotangent `r`, the block's output `y`, the layer's
load-balancing loss `aux` (transformers' `load_balancing_loss_func` on this layer's router
logits) and the gradient of `sum(y * r) + coef * aux` for every weight (`grad.<name>`).
The Rust test (tests/moe.rs) loads the weights by those names and compares.

    bash ../shared/tools/torch-env.sh && ~/.cache/pipewright-torch-env/bin/pip install transformers
    ~/.cache/pipewright-torch-env/bin/python tools/make_moe_fixtures.py
"""
import os
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
out_dir = os.path.join(root, "crates/pipewright-models/tests/fixtures")
COEF = 0.02


def make(name, model):
    torch.manual_seed(1)
    block = model.model.layers[0].mlp
    cfg = model.config
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
            keys = [k for k in f.keys() if k.startswith("model.layers.0.") and ("mlp" in k or "block_sparse_moe" in k)]
            hub = {k: f.get_tensor(k).float() for k in keys}
    x = torch.randn(1, 7, cfg.hidden_size)
    r = torch.randn(1, 7, cfg.hidden_size)
    y = block(x)
    logits = block.gate(x.reshape(-1, cfg.hidden_size))[0]
    aux = load_balancing_loss_func((logits,), cfg.num_experts if hasattr(cfg, "num_experts") and cfg.num_experts else cfg.num_local_experts, cfg.num_experts_per_tok)
    loss = (y * r).sum() + COEF * aux
    loss.backward()
    # The fused parameters' gradients under the Hub's per-expert names.
    e_count, ffn = block.experts.gate_up_proj.shape[0], block.experts.gate_up_proj.shape[1] // 2
    gu, dn = block.experts.gate_up_proj, block.experts.down_proj
    grads = {}
    for k in hub:
        tail = k.split(".experts.")[-1] if ".experts." in k else None
        if tail is None:
            grads["grad." + k] = block.gate.weight.grad
            assert torch.equal(hub[k], block.gate.weight.detach()), k
            continue
        e, part = int(tail.split(".")[0]), tail.split(".")[1]
        if part in ("w1", "gate_proj"):
            w, g = gu[e][:ffn], gu.grad[e][:ffn]
        elif part in ("w3", "up_proj"):
            w, g = gu[e][ffn:], gu.grad[e][ffn:]
        else:
            w, g = dn[e], dn.grad[e]
        assert torch.equal(hub[k], w.detach()), k
        grads["grad." + k] = g
    tensors = {**hub, **grads, "x": x, "r": r, "y": y.detach(), "aux": aux.detach().reshape(()),
               "coef": torch.tensor(COEF)}
    save_file({k: v.contiguous().float() for k, v in tensors.items()}, os.path.join(out_dir, f"moe-{name}.safetensors"))
    print(name, sorted(hub))


torch.manual_seed(0)
mix = MixtralForCausalLM(MixtralConfig(
    vocab_size=32, hidden_size=16, intermediate_size=12, num_hidden_layers=1, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16))
make("mixtral", mix)
torch.manual_seed(0)
qwen = Qwen3MoeForCausalLM(Qwen3MoeConfig(
    vocab_size=32, hidden_size=16, intermediate_size=24, moe_intermediate_size=12, num_hidden_layers=1,
    num_attention_heads=4, num_key_value_heads=2, head_dim=4, num_experts=4, num_experts_per_tok=2,
    norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=16))
make("qwen3moe", qwen)
