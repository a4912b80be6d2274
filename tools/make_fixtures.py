"""Makes the PyTorch fixtures the Rust tests compare against (CI uses only the files).

Run with the venv of ../shared/tools/torch-env.sh plus `pip install transformers`:
    $VENV/bin/python tools/make_fixtures.py

- crates/pipewright-models/tests/fixtures/gpt2_parity.safetensors: Hugging Face's own
  GPT2LMHeadModel (eager attention, gelu_new, tied lm_head) with perturbed random weights, a
  batch, the cross-entropy loss (ignore_index -100) and every parameter's gradient.
- crates/pipewright-models/tests/fixtures/llama_parity.safetensors: Hugging Face's
  LlamaForCausalLM (eager attention, grouped-query: 4 query heads over 2 key/value heads, SwiGLU,
  RMSNorm, rotary, untied head) with perturbed random weights, a batch, the loss and every
  gradient (`python tools/make_fixtures.py llama` makes only this one).
- crates/pipewright-models/tests/fixtures/hf-gpt2/ and hf-llama/: the two parity models as
  `save_pretrained` writes them (config.json and safetensors; the Llama sharded over several
  files with model.safetensors.index.json), made from the parity files' parameters
  (`python tools/make_fixtures.py hf` makes only these), for `--init-from` and export.
- crates/pipewright-models/tests/fixtures/generate.json: transformers' greedy `generate` of 8
  tokens after a prompt, for both directories, hf-mixtral and hf-qwen3moe (tools/make_moe_fixtures.py hf) (`python tools/make_fixtures.py generate`).
- crates/pipewright/tests/fixtures/optim.safetensors: torch.optim.AdamW / SGD trajectories over
  three steps with changing learning rates, and torch.nn.utils.clip_grad_norm_.
"""
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
torch.manual_seed(1234)


def batch_loss_grads(model, vocab, config, name=lambda n: n):
    """A random batch of 3 x 12 tokens (a few targets ignored) through `model`: the batch, the
    cross-entropy loss, the logits, and every parameter (`name` maps its name) and its gradient,
    with the model's sizes under "config"."""
    b, t = 3, 12
    ids = torch.randint(0, vocab, (b, t))
    targets = torch.randint(0, vocab, (b, t))
    targets[0, :4] = -100
    targets[2, 7] = -100
    logits = model(ids).logits
    loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=-100)
    loss.backward()
    out = {
        "config": torch.tensor(config, dtype=torch.int64),
        "input_ids": ids.to(torch.int64),
        "targets": targets.to(torch.int64),
        "loss": loss.detach().reshape(1),
        "logits": logits.detach().contiguous(),
    }
    for n, p in model.named_parameters():
        out["param." + name(n)] = p.detach().clone().contiguous()
        out["grad." + name(n)] = p.grad.detach().clone().contiguous()
    return out


def gpt2_parity():
    vocab, block, n_layer, n_head, n_embd = 50, 16, 2, 4, 32
    cfg = GPT2Config(
        vocab_size=vocab, n_positions=block, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
        activation_function="gelu_new", tie_word_embeddings=True,
        attn_implementation="eager", bos_token_id=0, eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    out = batch_loss_grads(model, vocab, [vocab, block, n_layer, n_head, n_embd],
                           lambda n: n.removeprefix("transformer."))
    # The tie is one parameter in PyTorch; pipewright keeps two equal ones.
    out["param.lm_head.weight"] = out["param.wte.weight"].clone()
    out["grad.lm_head.weight"] = out["grad.wte.weight"].clone()
    path = os.path.join(ROOT, "crates/pipewright-models/tests/fixtures/gpt2_parity.safetensors")
    save_file(out, path)
    print("wrote", path, "loss", out["loss"].item())


def optim():
    shapes = {"a.weight": (4, 3), "a.bias": (3,), "b.weight": (2, 2, 2)}
    lrs = [0.01, 0.02, 0.005]
    init = {n: torch.randn(s) for n, s in shapes.items()}
    grads = [{n: torch.randn(s) for n, s in shapes.items()} for _ in lrs]
    out = {}
    for n in shapes:
        out["init." + n] = init[n]
        for k, g in enumerate(grads):
            out[f"grad{k}.{n}"] = g[n]

    def run(tag, make):
        params = {n: torch.nn.Parameter(init[n].clone()) for n in shapes}
        opt = make(params)
        for k, lr in enumerate(lrs):
            for g in opt.param_groups:
                g["lr"] = lr
            for n, p in params.items():
                p.grad = grads[k][n].clone()
            opt.step()
            for n, p in params.items():
                out[f"{tag}.step{k}.{n}"] = p.detach().clone()

    decay = lambda ps: [ps["a.weight"], ps["b.weight"]]
    no_decay = lambda ps: [ps["a.bias"]]
    run("adamw", lambda ps: torch.optim.AdamW(
        [{"params": decay(ps), "weight_decay": 0.1}, {"params": no_decay(ps), "weight_decay": 0.0}],
        lr=0.01, betas=(0.9, 0.99), eps=1e-6))
    run("sgd_plain", lambda ps: torch.optim.SGD(list(ps.values()), lr=0.01))
    run("sgd_momentum", lambda ps: torch.optim.SGD(list(ps.values()), lr=0.01, momentum=0.9, dampening=0.1, weight_decay=0.01))
    run("sgd_nesterov", lambda ps: torch.optim.SGD(list(ps.values()), lr=0.01, momentum=0.9, nesterov=True, weight_decay=0.01))

    params = {n: torch.nn.Parameter(init[n].clone()) for n in shapes}
    for n, p in params.items():
        p.grad = grads[0][n].clone()
    norm = torch.nn.utils.clip_grad_norm_(list(params.values()), max_norm=0.5)
    out["clip.norm"] = norm.reshape(1)
    for n, p in params.items():
        out["clip." + n] = p.grad.clone()
    path = os.path.join(ROOT, "crates/pipewright/tests/fixtures/optim.safetensors")
    save_file({k: v.contiguous() for k, v in out.items()}, path)
    print("wrote", path)


def llama_parity():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4321)
    vocab, block, n_layer, n_head, n_kv, dim, hidden = 48, 16, 2, 4, 2, 32, 56
    eps, theta = 1e-5, 10000.0
    cfg = LlamaConfig(
        vocab_size=vocab, max_position_embeddings=block, num_hidden_layers=n_layer,
        num_attention_heads=n_head, num_key_value_heads=n_kv, hidden_size=dim,
        intermediate_size=hidden, rms_norm_eps=eps, rope_theta=theta, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, attn_implementation="eager", hidden_act="silu",
        bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    out = batch_loss_grads(model, vocab, [vocab, block, n_layer, n_head, n_kv, dim, hidden])
    out["config_f"] = torch.tensor([eps, theta], dtype=torch.float64)
    path = os.path.join(ROOT, "crates/pipewright-models/tests/fixtures/llama_parity.safetensors")
    save_file(out, path)
    print("wrote", path, "loss", out["loss"].item())


def hf_dirs():
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    fx = os.path.join(ROOT, "crates/pipewright-models/tests/fixtures")
    f = load_file(os.path.join(fx, "gpt2_parity.safetensors"))
    vocab, block, n_layer, n_head, n_embd = f["config"].tolist()
    gpt = GPT2LMHeadModel(GPT2Config(
        vocab_size=vocab, n_positions=block, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
        activation_function="gelu_new", tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
    ))
    state = {("" if k == "param.lm_head.weight" else "transformer.") + k[6:]: v
             for k, v in f.items() if k.startswith("param.")}
    gpt.load_state_dict(state, strict=False)
    gpt.save_pretrained(os.path.join(fx, "hf-gpt2"))
    f = load_file(os.path.join(fx, "llama_parity.safetensors"))
    vocab, block, n_layer, n_head, n_kv, dim, hidden = f["config"].tolist()
    eps, theta = f["config_f"].tolist()
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, max_position_embeddings=block, num_hidden_layers=n_layer,
        num_attention_heads=n_head, num_key_value_heads=n_kv, hidden_size=dim,
        intermediate_size=hidden, rms_norm_eps=eps, rope_theta=theta, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, hidden_act="silu", bos_token_id=0, eos_token_id=0,
    ))
    llama.load_state_dict({k[6:]: v for k, v in f.items() if k.startswith("param.")})
    llama.save_pretrained(os.path.join(fx, "hf-llama"), max_shard_size="60KB")
    print("wrote", os.path.join(fx, "hf-gpt2"), os.path.join(fx, "hf-llama"))


def generate_fixture():
    import json

    from transformers import AutoModelForCausalLM

    fx = os.path.join(ROOT, "crates/pipewright-models/tests/fixtures")
    out = {}
    for name in ["hf-gpt2", "hf-llama", "hf-mixtral", "hf-qwen3moe"]:
        m = AutoModelForCausalLM.from_pretrained(os.path.join(fx, name))
        prompt = [3, 1, 4, 1, 5]
        g = m.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                       pad_token_id=0, eos_token_id=None)
        out[name] = {"prompt": prompt, "greedy": g[0, len(prompt):].tolist()}
    with open(os.path.join(fx, "generate.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", os.path.join(fx, "generate.json"), out)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["llama"]:
        llama_parity()
    elif sys.argv[1:] == ["hf"]:
        hf_dirs()
    elif sys.argv[1:] == ["generate"]:
        generate_fixture()
    else:
        gpt2_parity()
        optim()
        llama_parity()
        hf_dirs()
        generate_fixture()
