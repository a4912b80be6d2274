"""One training step of the benchmark GPT in PyTorch eager, 2 threads, f32: Hugging Face's
GPT2LMHeadModel (eager attention, gelu_new, tied head) with the sizes of
crates/pipewright-models/benches/gpt_step.rs, cross-entropy, AdamW. Prints the median.

The same environment as the Rust bench picks other runs: PW_BENCH_SIZE=gpt2 (GPT-2 124M:
vocabulary 50257, d 768, 12 layers, 12 heads, sequence 1024), gpt-1.3b, llama-1b
(transformers' LlamaForCausalLM) and moe-small (MixtralForCausalLM) as the Rust bench
has them, PW_BENCH_BATCH,
PW_BENCH_DEVICE (cpu, cuda, cuda:N) and PW_BENCH_PRECISION (f32; bf16 and f16 under
torch.autocast, the weights and AdamW in f32 as pipewright keeps its master copy). It also
prints tokens/s, the model FLOPs of a step (PaLM's count, as the Rust bench), MFU when
PW_BENCH_PEAK_TFLOPS is set, and on a GPU the peak memory allocated.

PW_BENCH_TORCH=compiled runs PyTorch as fast as it goes instead of eager: attention through
scaled_dot_product_attention (flash attention on a GPU), the model under torch.compile and
AdamW's fused kernel: the runtime the planner's roofline models (fused element-wise passes,
products at the device's curve), to compare `plan`'s prediction with."""
import os
import time

import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

torch.set_num_threads(int(os.environ.get("TORCH_THREADS", "2")))
torch.manual_seed(0)
steps = int(os.environ.get("PW_BENCH_STEPS", "5"))
size = os.environ.get("PW_BENCH_SIZE")
if size == "gpt2":
    vocab, seq, d, layers, heads = 50257, 1024, 768, 12, 12
elif size == "gpt2-medium":  # PyTorch only: GPT-2 350M, for the planner's GPU rows
    vocab, seq, d, layers, heads = 50257, 1024, 1024, 24, 16
elif size == "gpt-1.3b":  # GPT-3 XL's shapes (heads of 128) at 1024 tokens
    vocab, seq, d, layers, heads = 50257, 1024, 2048, 24, 16
elif size == "llama-1b":  # Llama 3.2 1B's shapes (grouped-query attention, untied head)
    vocab, seq, d, layers, heads = 128256, 2048, 2048, 16, 32
elif size == "moe-small":  # a small Mixtral: 8 experts of 3584, top 2
    vocab, seq, d, layers, heads = 32000, 1024, 1024, 8, 16
else:
    vocab, seq, d, layers, heads = 4096, 256, 512, 4, 8
batch = int(os.environ.get("PW_BENCH_BATCH", "8"))
device = torch.device(os.environ.get("PW_BENCH_DEVICE", "cpu"))
precision = os.environ.get("PW_BENCH_PRECISION", "f32")
compiled = os.environ.get("PW_BENCH_TORCH", "eager") == "compiled"
low = {"f32": None, "bf16": torch.bfloat16, "f16": torch.float16}[precision]
attn = "sdpa" if compiled else "eager"
# Parameters a token does not multiply (PaLM's count, as the Rust bench's): the input
# embedding's table of an untied model, the experts its router leaves.
idle = 0
if size == "llama-1b":
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=8192,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=8,
                      max_position_embeddings=seq, rms_norm_eps=1e-5, rope_theta=500000.0,
                      tie_word_embeddings=False, attn_implementation=attn)
    model = LlamaForCausalLM(cfg).to(device)
    idle = vocab * d
elif size == "moe-small":
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=vocab, hidden_size=d, intermediate_size=3584,
                        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=4,
                        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=seq,
                        rms_norm_eps=1e-5, tie_word_embeddings=False, output_router_logits=False,
                        attn_implementation=attn)
    model = MixtralForCausalLM(cfg).to(device)
    idle = vocab * d + layers * (8 - 2) * 3 * d * 3584
else:
    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=d, n_layer=layers, n_head=heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
                     activation_function="gelu_new", attn_implementation=attn,
                     bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=(compiled and device.type == "cuda") or None)
forward = torch.compile(model) if compiled else model
scaler = torch.amp.GradScaler(device.type, enabled=low is torch.float16)
ids = torch.randint(0, vocab, (batch, seq + 1), device=device)
x, y = ids[:, :-1], ids[:, 1:]


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=low, enabled=low is not None):
        logits = forward(x).logits
        loss = F.cross_entropy(logits.reshape(-1, vocab).float(), y.reshape(-1))
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


step()
sync()
times = []
for _ in range(steps):
    s = time.perf_counter()
    step()
    sync()
    times.append((time.perf_counter() - s) * 1e3)
times.sort()
median = times[len(times) // 2]
print("torch mode", "compiled" if compiled else "eager", "batch", batch, "vocab", vocab, "seq", seq,
      "d", d, "layers", layers, "heads", heads)
print("torch times_ms", [round(t, 1) for t in times])
print(f"torch_median_ms {median:.1f}")
params = sum(p.numel() for p in model.parameters())
tokens = batch * seq
flops = tokens * (6 * (params - idle) + 12 * layers * d * seq)
line = f"torch_tokens_per_s {tokens / (median / 1e3):.0f} model_tflop_per_step {flops / 1e12:.3f}"
if "PW_BENCH_PEAK_TFLOPS" in os.environ:
    line += f" mfu {flops / (median / 1e3) / (float(os.environ['PW_BENCH_PEAK_TFLOPS']) * 1e12):.3f}"
if device.type == "cuda":
    line += f" peak_memory_bytes {torch.cuda.max_memory_allocated(device)}"
print(line)

if os.environ.get("PW_BENCH_KERNELS") and device.type == "cuda":
    # One more step under the profiler: its kernels' time by kind, to set beside the
    # planner's parts (products, attention, element-wise passes, the loss, the optimizer).
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync()

    def kind(name):
        n = name.lower()
        if any(s in n for s in ["flash", "fmha", "sdpa", "attention", "cudnn"]):
            return "attention"
        if any(s in n for s in ["gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "cublas"]):
            return "products"
        if "adam" in n or "multi_tensor" in n:
            return "optimizer"
        if any(s in n for s in ["softmax", "nll", "cross_entropy"]):
            return "loss"
        if n.startswith("triton"):
            return "fused (triton)"
        return "other"

    kernels = [e for e in prof.key_averages()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    own = [(e.key, getattr(e, "self_device_time_total", 0) or e.self_cuda_time_total, e.count)
           for e in kernels]
    by_kind = {}
    for name, us, count in own:
        k = kind(name)
        t, c = by_kind.get(k, (0.0, 0))
        by_kind[k] = (t + us, c + count)
    total = sum(t for t, _ in by_kind.values())
    print(f"kernels: {total / 1e3:.2f} ms of GPU time in one step")
    for k, (t, c) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"  {k:<16} {t / 1e3:8.2f} ms {c:6d} kernels")
    for name, us, count in sorted(own, key=lambda x: -x[1])[:20]:
        print(f"  {us / 1e3:8.3f} ms {count:5d}x {kind(name):<14} {name[:90]}")
