#!/usr/bin/env python3
"""Where a GPU step's time goes: reads the CSV that
`ncu --profile-from-start off --metrics gpu__time_duration.sum --csv --print-units base`
wrote for the timed steps of benches/gpt_step.rs (PW_CUDA_PROFILE=1), sums the kernels' times
by kind (matrix products, element-wise, reductions, copies and casts, indexing, NCCL, ...) and
prints each kind's share, the ten longest kernels, and, given the step's wall time measured
without the profiler (--step-ms, per step), how much of the step the GPU was busy: the rest is
the host launching kernels and waiting.

usage: gpu_kernels.py NCU_CSV [--steps N] [--step-ms MS]
"""
import argparse
import collections
import csv
import re

KINDS = [
    ("matmul", r"gemm|gemv|cutlass|xmma|nvjet|cublas|sm90_|sm80_"),
    ("nccl", r"nccl"),
    ("attention", r"^(fa|attn)_|causal_softmax"),
    ("reduction", r"fast_(sum|max|min|argmax|argmin)|softmax|reduce|rmsnorm|layernorm"),
    ("copy/cast", r"copy|cast|transpose|memcpy"),
    ("indexing", r"^(is|ia|sa|gather|scatter|index)_|index_select|embedding"),
    ("fill", r"fill|memset|zeros|ones|const_set"),
    ("element-wise", r"^(b|u)[a-z]+_|affine|where|elu|gelu|silu|powf|clamp|cmp|_eq_|_lt_"),
]


def kind(name):
    for k, pattern in KINDS:
        if re.search(pattern, name):
            return k
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, default=1, help="timed steps the profile covers")
    ap.add_argument("--step-ms", type=float, help="a step's wall time without the profiler")
    a = ap.parse_args()
    with open(a.csv, errors="replace") as f:
        lines = [l for l in f if l.startswith('"')]
    rows = list(csv.DictReader(lines))
    rows = [r for r in rows if r.get("Metric Name") == "gpu__time_duration.sum"]
    if not rows:
        raise SystemExit(f"{a.csv}: no gpu__time_duration.sum rows (did ncu profile anything?)")
    by_kind = collections.Counter()
    by_name = collections.Counter()
    for r in rows:
        ns = float(r["Metric Value"].replace(",", ""))
        name = r["Kernel Name"].split("(")[0].split("<")[0].strip()
        by_kind[kind(name)] += ns
        by_name[name] += ns
    total = sum(by_kind.values())
    per_step_ms = total / 1e6 / a.steps
    print(f"{len(rows) // a.steps} kernels per step, {per_step_ms:.1f} ms of kernel time per step")
    for k, ns in by_kind.most_common():
        print(f"  {k:<13} {ns / 1e6 / a.steps:8.2f} ms  {100 * ns / total:5.1f} %")
    print("longest kernels (ms per step):")
    for name, ns in by_name.most_common(10):
        print(f"  {ns / 1e6 / a.steps:8.2f}  {name[:100]}")
    if a.step_ms:
        busy = per_step_ms / a.step_ms
        print(f"GPU busy {100 * busy:.0f} % of the {a.step_ms:.1f} ms step; "
              f"{a.step_ms - per_step_ms:.1f} ms is the host launching and waiting")


if __name__ == "__main__":
    main()
