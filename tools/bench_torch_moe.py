"""One training step of the benchmark mixture-of-experts Llama in PyTorch eager, 2 threads, f32:
Hugging Face's MixtralForCausalLM (eager attention) with the sizes of
crates/pipewright-models/benches/moe_step.rs (d 256, 4 layers, 8 heads over 4 key/value heads,
8 experts of width 512, 2 per token, vocabulary 4096, sequence 256, batch 8), cross-entropy
plus the load-balancing loss at 0.02, AdamW. Prints the median of PW_BENCH_STEPS (5) steps
after one warm-up.

    $VENV/bin/python tools/bench_torch_moe.py   # VENV: ../shared/tools/torch-env.sh + transformers
"""
import os
import time

import torch
import torch.nn.functional as F
from transformers import MixtralConfig, MixtralForCausalLM

torch.set_num_threads(int(os.environ.get("TORCH_THREADS", "2")))
torch.manual_seed(0)
steps = int(os.environ.get("PW_BENCH_STEPS", "5"))
vocab, seq, batch = 4096, 256, 8
cfg = MixtralConfig(
    vocab_size=vocab, max_position_embeddings=seq, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, hidden_size=256, intermediate_size=512, num_local_experts=8,
    num_experts_per_tok=2, router_aux_loss_coef=0.02, router_jitter_noise=0.0, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=False, attn_implementation="eager",
    output_router_logits=True, bos_token_id=0, eos_token_id=0,
)
model = MixtralForCausalLM(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, vocab, (batch, seq + 1))
x, y = ids[:, :-1], ids[:, 1:]


def step():
    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out.logits.reshape(-1, vocab), y.reshape(-1))
    loss = loss + cfg.router_aux_loss_coef * out.aux_loss
    loss.backward()
    opt.step()


step()
times = []
for _ in range(steps):
    s = time.perf_counter()
    step()
    times.append((time.perf_counter() - s) * 1e3)
times.sort()
n = sum(p.numel() for p in model.parameters())
print(f"torch mixtral params={n} times_ms={[round(t, 1) for t in times]}")
print(f"torch_median_ms {times[len(times) // 2]:.1f}")
