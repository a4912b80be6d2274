"""One training step of the benchmark GPT in PyTorch eager, 2 threads, f32: Hugging Face's
GPT2LMHeadModel (eager attention, gelu_new, tied head) with the sizes of
crates/pipewright-models/benches/gpt_step.rs, cross-entropy, AdamW. Prints the median."""
import os
import time

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

torch.set_num_threads(int(os.environ.get("TORCH_THREADS", "2")))
torch.manual_seed(0)
steps = int(os.environ.get("PW_BENCH_STEPS", "5"))
batch, seq, vocab = 8, 256, 4096
cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=512, n_layer=4, n_head=8,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                 activation_function="gelu_new", attn_implementation="eager",
                 bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(cfg)
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
print("torch times_ms", [round(t, 1) for t in times])
print(f"torch_median_ms {times[len(times) // 2]:.1f}")
