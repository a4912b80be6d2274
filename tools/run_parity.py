#!/usr/bin/env python3
"""A whole training run in PyTorch on exactly the batches `pipewright train --task tokens`
draws, from the same Hugging Face initial weights, with the same optimizer, schedule and
clipping (issue 61's run-level parity harness).

    pipewright data windows --data SHARDS --block-size B --batch-size N --steps S --seed K \
        --out windows.csv
    python3 tools/run_parity.py MODEL_DIR SHARDS windows.csv torch.csv [--lr ...]
    pipewright train --model llama --task tokens --data SHARDS --init-from MODEL_DIR \
        --block-size B --batch-size N --steps S --seed K ... --out runs/pw

then compare `torch.csv` with `runs/pw/scalars.csv` step by step (their `loss` columns;
tools/run_parity_matrix.sh does, for the test fixture's models on several layouts).

What it does as pipewright does: the loss is the mean cross-entropy of the batch's tokens;
AdamW (torch.optim.AdamW) decays the parameters of two or more dimensions (matrices and
embeddings; `--decay matrices`: not the embedding tables), not the others (pipewright's
`AdamWConfig::decays`); the learning rate of step s (from 0) is
lr (s + 1) / warmup during the warm-up, then a cosine from lr to lr x min_lr_ratio at the last
step (pipewright's `LrSchedule::WarmupCosine::lr_at`); the global gradient norm is clipped to
`--clip` (0: not) as `clip_grad_norm_` does (pipewright's `scale_to_norm`: the same formula).
At the end: the held-out perplexity over the same windows pipewright evaluates (up to 64,
spread evenly over the held-out split), printed and written as the last row (step 0).
Needs torch, transformers and numpy (../shared/tools/torch-env.sh, then pip install
transformers). f32, CPU."""
import argparse
import csv
import glob
import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM


def stream(shards, split):
    dtype = {"u16": np.uint16, "u32": np.uint32}[json.load(open(os.path.join(shards, "index.json")))["dtype"]]
    files = sorted(glob.glob(os.path.join(shards, f"{split}-*.bin")))
    return np.concatenate([np.fromfile(f, dtype=dtype) for f in files]).astype(np.int64)


def batch(ids, windows, block):
    x = np.stack([ids[w * block: w * block + block] for w in windows])
    y = np.stack([ids[w * block + 1: w * block + block + 1] for w in windows])
    return torch.from_numpy(x), torch.from_numpy(y)


def lr_at(step, a):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    if step >= a.steps or a.steps <= a.warmup:
        return a.lr * a.min_lr_ratio
    t = (step - a.warmup) / (a.steps - a.warmup)
    lo = a.lr * a.min_lr_ratio
    return lo + 0.5 * (a.lr - lo) * (1 + math.cos(math.pi * t))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("shards")
    p.add_argument("windows")
    p.add_argument("out")
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--decay", choices=["matrices-and-embeddings", "matrices"],
                   default="matrices-and-embeddings")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    rows = [(int(r["step"]), [int(w) for w in r["windows"].split()]) for r in csv.DictReader(open(a.windows))]
    a.steps = len(rows)
    model = AutoModelForCausalLM.from_pretrained(a.model, torch_dtype=torch.float32)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    # Embedding tables (and GPT-2's head, the same tensor as its token embedding) are left
    # out of the decay with --decay matrices, as pipewright's `--decay matrices`.
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    decays = [p for p in params if p.dim() >= 2 and (a.decay != "matrices" or id(p) not in tables)]
    chosen = {id(p) for p in decays}
    groups = [
        {"params": decays, "weight_decay": a.weight_decay},
        {"params": [p for p in params if id(p) not in chosen], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=a.eps)
    train = stream(a.shards, "train")
    out = open(a.out, "w")
    out.write("step,loss,lr,grad_norm\n")
    for step, windows in rows:
        lr = lr_at(step - 1, a)
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(train, windows, a.block_size)
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, a.clip if a.clip > 0 else float("inf"))
        opt.step()
        out.write(f"{step},{loss.item()!r},{lr!r},{norm.item()!r}\n")
        out.flush()
    valid = stream(a.shards, "valid")
    n = (len(valid) - 1) // a.block_size
    k = min(n, 64)
    windows = [i * n // k for i in range(k)]
    model.eval()
    total = 0.0
    with torch.no_grad():
        for c in range(0, k, 16):
            x, y = batch(valid, windows[c:c + 16], a.block_size)
            logits = model(input_ids=x).logits
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item() * len(x)
    ppl = math.exp(total / k)
    out.write(f"0,{total / k!r},0,0\n")
    print(f"held-out perplexity {ppl:.4f} over {k} windows; losses in {a.out}")


if __name__ == "__main__":
    main()
