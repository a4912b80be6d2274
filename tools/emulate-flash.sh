#!/usr/bin/env bash
# Runs the tensor-core flash attention kernels (crates/pipewright/src/model/kernels/cuda/flash.cu)
# on this machine's CPU, no GPU needed: tools/emulate-flash/transform.py rewrites them as host
# C++, shim.h emulates the GPU's threads, barriers, shuffles and mma.sync, and harness.cpp
# checks the forward and both backward kernels against f64 causal attention. The CUDA
# headers (bf16 and f16 conversions) come from tools/build-cuda.sh's environment, which it
# makes if it is missing. A check of the kernels' index arithmetic and fragment layouts before a
# GPU is at hand; tools/gpu-checks.sh `kernels` is the check on the GPU itself.
set -euo pipefail
cd "$(dirname "$0")/.."
env_dir=${PIPEWRIGHT_CUDA_ENV:-$HOME/.cache/pipewright-cuda-env}
[ -x "$env_dir/bin/python" ] || bash tools/build-cuda.sh cargo --version >/dev/null
include=$("$env_dir/bin/python" -c 'import nvidia; print(list(nvidia.__path__)[0])')/cu13/include
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 tools/emulate-flash/transform.py crates/pipewright/src/model/kernels/cuda/ "$work"
cp tools/emulate-flash/shim.h tools/emulate-flash/harness.cpp "$work/"
# The kernels read elements as wider words (as CUDA code does); g++ must not assume they
# cannot alias.
g++ -std=c++20 -O2 -fno-strict-aliasing -I"$include" "$work/harness.cpp" -o "$work/harness" -lpthread
"$work/harness"
