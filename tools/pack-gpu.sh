#!/usr/bin/env bash
# Builds what tools/gpu-checks.sh runs on a GPU machine and packs it into gpu/ (ignored by git):
# the CUDA `pipewright`, the GPT step bench, and the HF GPT-2 parity and NCCL test binaries,
# stripped and xz-compressed (about 7 MB each instead of 56: the device's working tree, carried
# paths included, may hold 64 MiB). Carry `gpu` with the device call.
set -euo pipefail
cd "$(dirname "$0")/.."
build() { bash tools/build-cuda.sh cargo "$@" --message-format json-render-diagnostics; }
rm -rf gpu && mkdir gpu
pick() { # the executable of each compiler-artifact line whose target is named $1
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == sys.argv[1] and m.get("executable"):
        print(m["executable"])' "$1" | tail -1
}
cli=$(build build --release -p pipewright-cli --features cuda | pick pipewright)
bench=$(build bench --no-run -p pipewright-models --bench gpt_step --features pipewright-models/cuda | pick gpt_step)
parity=$(build test --release --no-run -p pipewright-models --test gpt_parity --features pipewright-models/cuda | pick gpt_parity)
nccl=$(build test --release --no-run -p pipewright --test nccl_probe --features pipewright/cuda | pick nccl_probe)
for pair in "pipewright:$cli" "gpt_step:$bench" "gpt_parity:$parity" "nccl_probe:$nccl"; do
  strip -o "gpu/${pair%%:*}" "${pair#*:}"
  xz -T0 -6 "gpu/${pair%%:*}"
done
ls -l gpu
