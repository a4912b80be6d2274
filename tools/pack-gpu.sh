#!/usr/bin/env bash
# Builds what tools/gpu-checks.sh runs on a GPU machine and packs it into gpu/ (ignored by git):
# the CUDA `pipewright`, the same with Open MPI (`pipewright-mpi`, for ranks as processes
# sharing the GPU), the GPT step bench, the library's tests (the CUDA kernels against their
# CPU twins), the HF GPT-2, Llama and MoE parity and NCCL test binaries,
# stripped and xz-compressed (about 7 MB each instead of 56: the device's working tree, carried
# paths included, may hold 64 MiB); and this machine's Open MPI runtime (gpu/mpi.txz,
# tools/pack-mpi.sh), since the GPU machine has none. Carry `gpu` with the device call.
#
#   tools/pack-gpu.sh            build and pack
#   tools/pack-gpu.sh --fast     build and pack uncompressed (CI: that everything builds, and the
#                                Open MPI pack tools/mpi_packed_check.sh runs; xz -6 takes about
#                                35 s a binary here, four minutes in all)
set -euo pipefail
fast=false
[ "${1:-}" = --fast ] && fast=true
cd "$(dirname "$0")/.."
rm -rf gpu && mkdir gpu
pack() { # NAME TARGET CARGO-ARGS...: builds, then strips and compresses TARGET's executable as gpu/NAME
  local name=$1 target=$2 exe
  shift 2
  exe=$(bash tools/build-cuda.sh cargo "$@" --message-format json-render-diagnostics | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == sys.argv[1] and m.get("executable"):
        print(m["executable"])' "$target" | tail -1)
  strip -o "gpu/$name" "$exe"
  $fast || xz -T0 -6 "gpu/$name"
}
pack pipewright pipewright build --release -p pipewright-cli --features cuda
pack pipewright-mpi pipewright build --release -p pipewright-cli --features cuda,mpi
pack gpt_step gpt_step bench --no-run -p pipewright-models --bench gpt_step --features pipewright-models/cuda
pack gpt_parity gpt_parity test --release --no-run -p pipewright-models --test gpt_parity --features pipewright-models/cuda
pack llama_parity llama_parity test --release --no-run -p pipewright-models --test llama_parity --features pipewright-models/cuda
pack hf_moe hf_moe test --release --no-run -p pipewright-models --test hf_moe --features pipewright-models/cuda
pack lib_tests pipewright test --release --no-run -p pipewright --lib --features pipewright/cuda
pack nccl_probe nccl_probe test --release --no-run -p pipewright --test nccl_probe --features pipewright/cuda
bash tools/pack-mpi.sh gpu/mpi.txz
ls -l gpu
