"""The planner beside PyTorch's compiled GPT steps on one GPU (docs/planner.md, "One GPU"):
for each `tools/bench_torch.py` log of a compiled run (PW_BENCH_TORCH=compiled) given, the
step `pipewright plan --world 1 --hardware HW --precision bf16` predicts for the same model
and batch (one rank, the whole batch one micro-batch) and its peak, beside the measured median
step and `max_memory_allocated`; prints a markdown table. `tools/gpu-checks.sh planner` runs
it on the hardware file it measured.

    python3 tools/planner_vs_torch.py PIPEWRIGHT HW.json LOG...

PIPEWRIGHT is the command that runs the binary, words split on spaces (on a GPU machine
`"bash tools/run-on-gpu.sh gpu/pipewright"`).
"""
import re
import subprocess
import sys

pipewright, hw, logs = sys.argv[1], sys.argv[2], sys.argv[3:]
UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}
print("| model | batch | measured step | predicted | error | measured peak | predicted | error |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for log in logs:
    text = open(log).read()
    mode = re.search(r"^torch mode (\w+) batch (\d+) vocab (\d+) seq (\d+) d (\d+) layers (\d+) "
                     r"heads (\d+)$", text, re.M)
    if not mode or mode.group(1) != "compiled":
        continue
    batch, vocab, seq, d, layers, heads = (int(g) for g in mode.groups()[1:])
    step_ms = float(re.search(r"^torch_median_ms ([\d.]+)", text, re.M).group(1))
    peak_mib = int(re.search(r"peak_memory_bytes (\d+)", text).group(1)) / 2**20
    out = subprocess.run(
        pipewright.split() + ["plan", "--world", "1", "--model", "gpt", "--task", "text", "--data",
         "README.md", "--block-size", str(seq), "--vocab-size", str(vocab), "--n-layer",
         str(layers), "--n-head", str(heads), "--n-embd", str(d), "--batch-size", str(batch),
         "--precision", "bf16", "--hardware", hw, "--candidate",
         f"pp=1,tp=1,dp=1,mbs={batch},schedule=1f1b,recompute=never,zero=0"],
        check=True, capture_output=True, text=True).stdout
    row = next(line for line in out.splitlines() if line.startswith("1 ") and "pp=1" in line)
    m = re.search(r"([\d.]+) (us|ms|s)\s+[\d.]+%\s+([\d.]+) (KiB|MiB|GiB)\s*$", row)
    pred_ms = float(m.group(1)) * UNITS[m.group(2)]
    pred_mib = float(m.group(3)) * UNITS[m.group(4)]
    print(f"| {layers} x {d} ({heads} heads) | {batch} | {step_ms:.1f} ms | {pred_ms:.1f} ms | "
          f"{(pred_ms / step_ms - 1) * 100:+.1f} % | {peak_mib / 1024:.1f} GiB | "
          f"{pred_mib / 1024:.1f} GiB | {(pred_mib / peak_mib - 1) * 100:+.0f} % |")
