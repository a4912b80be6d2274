"""The products a hardware file's curves were fitted to (`pipewright profile --gemm` writes their
timings into `gemm_f32.measured` and `gemm_half.measured`), timed again in PyTorch on the same
device in the same way (a warm-up, then the median of 5 runs, each waiting for the device), side
by side: an independent check of the timings pipewright's curve rests on. Also the device's
streaming bandwidth, as the planner charges element-wise passes (`memory_bandwidth_bytes_per_s`):
a copy and an element-wise sum of 256 MiB tensors, counting the bytes read and written.

With --write it also times PyTorch's fused causal attention in bf16
(scaled_dot_product_attention: flash attention on a GPU) at heads of width 64 and 128 over 512
to 8192 tokens, forward and backward, and rewrites the file with them in `gemm_half.attention`
(as `pipewright profile --gemm` writes its own kernel's on a CPU; `plan/attention_rate.rs`: the
planner costs fused attention at these rates; the backward ratio is the sum of the backwards
over the sum of the forwards, as `AttentionRate::fit` computes it) and with the bf16
element-wise sum's streaming rate as `memory_bandwidth_bytes_per_s`, what the planner charges
element-wise passes at (a file made on top of another device's keeps that one's otherwise).

    python3 tools/gemm_torch.py HARDWARE.json [--write] [cuda]
"""
import json
import sys
import time

import torch
import torch.nn.functional as F

write = "--write" in sys.argv
args = [a for a in sys.argv[1:] if a != "--write"]
path = args[0]
device = torch.device(args[1] if len(args) > 1 else "cuda")
torch.backends.cuda.matmul.allow_tf32 = False  # f32 products in f32, as candle computes them
hw = json.load(open(path))


def sync():
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, repeats=5, setup=None):
    """Median seconds of `fn()` (or `fn(setup())`, the setup untimed) after a warm-up."""
    times = []
    for _ in range(repeats + 1):
        arg = (setup(),) if setup else ()
        sync()
        start = time.perf_counter()
        fn(*arg)
        sync()
        times.append(time.perf_counter() - start)
    times = sorted(times[1:])
    return times[len(times) // 2]


for key, dtype in [("gemm_half", torch.bfloat16), ("gemm_f32", torch.float32)]:
    curve = hw.get(key)
    if not curve or not curve.get("measured"):
        continue
    print(f"{key} ({dtype}): m n k batch, pipewright us, torch us, pipewright/torch, torch TFLOP/s")
    flops = ours = theirs = 0.0
    for t in curve["measured"]:
        g = t["gemm"]
        a = torch.randn(g["batch"], g["m"], g["k"], device=device).to(dtype)
        b = torch.randn(g["batch"], g["k"], g["n"], device=device).to(dtype)
        s = median_seconds(lambda: a @ b)
        f = 2.0 * g["batch"] * g["m"] * g["n"] * g["k"]
        flops, ours, theirs = flops + f, ours + t["seconds"], theirs + s
        print(f"{g['m']:>6} {g['n']:>6} {g['k']:>6} {g['batch']:>3} {t['seconds'] * 1e6:>10.1f} "
              f"{s * 1e6:>10.1f} {t['seconds'] / s:>6.2f} {f / s / 1e12:>8.1f}")
        del a, b
    print(f"{key} all shapes: pipewright {flops / ours / 1e12:.1f} TFLOP/s, torch "
          f"{flops / theirs / 1e12:.1f} TFLOP/s, time ratio {ours / theirs:.3f}")

streams = {}
for dtype in [torch.bfloat16, torch.float32]:
    n = (256 << 20) // torch.finfo(dtype).bits * 8
    a = torch.randn(n, device=device).to(dtype)
    b = torch.randn(n, device=device).to(dtype)
    q = a.element_size()
    copy = median_seconds(lambda: a.clone())
    add = median_seconds(lambda: a + b)
    streams[dtype] = 3 * n * q / add
    print(f"stream {dtype}: copy {2 * n * q / copy / 1e9:.0f} GB/s, "
          f"add {streams[dtype] / 1e9:.0f} GB/s (bytes read and written)")
if write:
    timings = []
    for head_dim in [64, 128]:
        for seq in [512, 1024, 2048, 4096, 8192]:
            pairs = 192 * 1024 // seq  # the same tokens x heads at every length
            q, k, v = (torch.randn(pairs // 8, 8, seq, head_dim, device=device,
                                   dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
            grad = torch.randn(pairs // 8, 8, seq, head_dim, device=device, dtype=torch.bfloat16)
            def attend():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            forward = median_seconds(attend)
            backward = median_seconds(lambda out: out.backward(grad), setup=attend)
            t = {"pairs": pairs, "seq": seq, "head_dim": head_dim, "forward_s": forward,
                 "backward_s": backward}
            work = 2.0 * pairs * seq * seq * head_dim
            print(f"attention {pairs:>4} pairs x {seq:>5} tokens, head {head_dim:>3}: forward "
                  f"{forward * 1e6:8.1f} us ({work / forward / 1e12:5.1f} TFLOP/s of causal work), "
                  f"backward {t['backward_s'] * 1e6:8.1f} us")
            timings.append(t)
            del q, k, v, grad
    ratio = sum(t["backward_s"] for t in timings) / sum(t["forward_s"] for t in timings)
    hw["gemm_half"]["attention"] = {"backward_ratio": ratio, "measured": timings}
    hw["memory_bandwidth_bytes_per_s"] = streams[torch.bfloat16]
    with open(path, "w") as f:
        json.dump(hw, f, indent=2)
    print(f"attention: backward {ratio:.2f}x the forward; written into {path} with the "
          f"streaming rate {streams[torch.bfloat16] / 1e9:.0f} GB/s")
print(f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}")
