#!/usr/bin/env bash
# Runs some of pipewright's CUDA kernels (crates/pipewright/src/kernels/cuda/) on this
# machine's CPU, no GPU needed: tools/emulate-kernels/transform.py rewrites them as host C++,
# shim.h emulates the GPU's threads, barriers, shuffles and mma.sync, and
#  - flash.cpp checks the tensor-core flash attention kernels (forward and both backward
#    kernels) against f64 causal attention and its gradients;
#  - table.cpp checks the kernels that take many tensors through a table (AdamW, the casts,
#    the sums of squares): every element of every item once, nothing past an item's end.
# The CUDA headers (bf16 and f16 conversions) come from tools/build-cuda.sh's environment,
# which it makes if it is missing. A check of the kernels' index arithmetic and fragment
# layouts before a GPU is at hand; tools/gpu-checks.sh `kernels` is the check on the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
env_dir=${PIPEWRIGHT_CUDA_ENV:-$HOME/.cache/pipewright-cuda-env}
[ -x "$env_dir/bin/python" ] || bash tools/build-cuda.sh cargo --version >/dev/null
include=$("$env_dir/bin/python" -c 'import nvidia; print(list(nvidia.__path__)[0])')/cu13/include
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 tools/emulate-kernels/transform.py crates/pipewright/src/kernels/cuda "$work" \
  flash adamw cast reduce
cp tools/emulate-kernels/*.h tools/emulate-kernels/*.cpp "$work/"
for harness in flash table; do
  # The kernels read elements as wider words (as CUDA code does): g++ must not assume they
  # cannot alias; and it must not fuse a multiply and an add the kernels round apart.
  g++ -std=c++20 -O2 -fno-strict-aliasing -ffp-contract=off -I"$include" \
    "$work/$harness.cpp" -o "$work/$harness" -lpthread
  "$work/$harness"
done
