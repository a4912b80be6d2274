"""Makes crates/pipewright-models/tests/fixtures/moe-{mixtral,qwen3moe}.safetensors: one sparse
mixture-of-experts block of Hugging Face's MixtralForCausalLM and Qwen3MoeForCausalLM (tiny
sizes, seeded), its weights under the names the Hub's checkpoints use (as `save_pretrained`
writes them), an input `x`, a cotangent `r`, the block's output `y`, the layer's
load-balancing loss `aux` (transformers' `load_balancing_loss_func` on this layer's router
logits) and the gradient of `sum(y * r) + coef * aux` for every weight (`grad.<name>`).
The Rust test (tests/moe.rs) loads the weights by those names and compares.

With `hf`: the whole tiny MixtralForCausalLM and Qwen3MoeForCausalLM as `save_pretrained` writes
them (fixtures/hf-mixtral/ and hf-qwen3moe/, sharded with an index) and
fixtures/{mixtral,qwen3moe}_parity.safetensors: a batch, its logits, the language-model loss and
every gradient under the Hub's names (tests/hf_moe.rs). The auxiliary
loss is left out there: transformers' Mixtral takes one over all layers' router logits joined,
pipewright (as Megatron and torchtitan) one per mixture, summed; with one mixture they agree,
as the block fixtures check.

    bash ../shared/tools/torch-env.sh && ~/.cache/pipewright-torch-env/bin/pip install transformers
    ~/.cache/pipewright-torch-env/bin/python tools/make_moe_fixtures.py [hf]
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


def blocks():
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


def hf_model(name, make_model, names):
    """A whole tiny model (`make_model()`) with perturbed weights, saved as `save_pretrained`
    writes it (sharded, with an index) into fixtures/hf-<name>/, and a batch of 4 x 12 tokens
    with its logits, the language-model loss (no auxiliary loss) and every parameter's gradient
    under the Hub's per-expert names (`names` maps a fused expert tensor to them) into
    fixtures/<name>_parity.safetensors."""
    torch.manual_seed(4321)
    model = make_model().float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    d = os.path.join(out_dir, f"hf-{name}")
    model.save_pretrained(d, max_shard_size="60KB")
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (4, 12))
    targets = torch.randint(0, vocab, (4, 12))
    targets[0, :4] = -100
    targets[2, 7] = -100
    logits = model(ids).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=-100)
    loss.backward()
    out = {"input_ids": ids, "targets": targets, "loss": loss.detach().reshape(1),
           "logits": logits.detach().contiguous()}
    for n, p in model.named_parameters():
        for hub, g in names(n, p.grad):
            out["grad." + hub] = g.contiguous()
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(out_dir, f"{name}_parity.safetensors"))
    print("wrote", d, "loss", loss.item())


def per_expert(w1, w3, w2, moe="mlp"):
    """The Hub's per-expert names of a fused expert gradient: `gate_up_proj` (E, 2F, D) is each
    expert's gate (`w1`) over its up (`w3`); `down_proj` (E, D, F) is `w2`; the mixture's module
    is `moe` on the Hub (Mixtral's `block_sparse_moe`; `mlp` in memory)."""
    def names(n, g):
        n = n.replace(".mlp.", f".{moe}.")
        if n.endswith("experts.gate_up_proj"):
            f = g.shape[1] // 2
            base = n[: -len("gate_up_proj")]
            return [x for e in range(g.shape[0]) for x in
                    ((f"{base}{e}.{w1}.weight", g[e][:f]), (f"{base}{e}.{w3}.weight", g[e][f:]))]
        if n.endswith("experts.down_proj"):
            base = n[: -len("down_proj")]
            return [(f"{base}{e}.{w2}.weight", g[e]) for e in range(g.shape[0])]
        return [(n, g)]
    return names


if __name__ == "__main__" and len(os.sys.argv) > 1 and os.sys.argv[1] == "hf":
    hf_model("mixtral", lambda: MixtralForCausalLM(MixtralConfig(
        vocab_size=48, hidden_size=32, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=16,
        rms_norm_eps=1e-5, rope_theta=10000.0, router_aux_loss_coef=0.02, router_jitter_noise=0.0,
        tie_word_embeddings=False, attn_implementation="eager", bos_token_id=0, eos_token_id=0)),
        per_expert("w1", "w3", "w2", "block_sparse_moe"))
    # Heads wider than hidden / heads, per-head query/key norms, the first block dense, the
    # top k not renormalised.
    hf_model("qwen3moe", lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=48, hidden_size=32, intermediate_size=24, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2,
        mlp_only_layers=[], max_position_embeddings=16, rms_norm_eps=1e-5, rope_theta=10000.0,
        router_aux_loss_coef=0.001, use_sliding_window=False, tie_word_embeddings=False,
        attn_implementation="eager", bos_token_id=0, eos_token_id=0)),
        per_expert("gate_proj", "up_proj", "down_proj"))

if __name__ == "__main__" and len(os.sys.argv) == 1:
    blocks()
