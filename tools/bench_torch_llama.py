"""One training step of the benchmark Llama in PyTorch eager, 2 threads, f32: Hugging Face's
LlamaForCausalLM (eager attention) with the sizes of crates/pipewright-models/benches/
llama_step.rs (d 512, 4 layers, 8 heads over 4 key/value heads, MLP 1376, vocabulary 4096,
sequence 256, batch 8), cross-entropy, AdamW. Prints the median of PW_BENCH_STEPS (5) steps
after one warm-up.

    $VENV/bin/python tools/bench_torch_llama.py   # VENV: ../shared/tools/torch-env.sh + transformers
"""
import os
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

torch.set_num_threads(int(os.environ.get("TORCH_THREADS", "2")))
torch.manual_seed(0)
steps = int(os.environ.get("PW_BENCH_STEPS", "5"))
vocab, seq, batch = 4096, 256, 8
cfg = LlamaConfig(
    vocab_size=vocab, max_position_embeddings=seq, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=4, hidden_size=512, intermediate_size=1376, rms_norm_eps=1e-5,
    rope_theta=10000.0, tie_word_embeddings=False, attn_implementation="eager",
    bos_token_id=0, eos_token_id=0,
)
model = LlamaForCausalLM(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
ids = torch.randint(0, vocab, (batch, seq + 1))
x, y = ids[:, :-1], ids[:, 1:]


def step():
    opt.zero_grad(set_to_none=True)
    logits = model(x).logits
    loss = F.cross_entropy(logits.reshape(-1, vocab), y.reshape(-1))
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
print(f"torch llama params={n} times_ms={[round(t, 1) for t in times]}")
print(f"torch_median_ms {times[len(times) // 2]:.1f}")
