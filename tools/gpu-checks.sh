#!/usr/bin/env bash
# Issue 17's checks on a GPU machine, in one call (device time is scarce): run from the
# repository root with gpu/ carried (tools/pack-gpu.sh made it). Each check's log goes to
# $OUT (or gpu/out) and a line per check says ok or FAILED; a failure does not stop the rest.
#  1. the HF GPT-2 fixture parity on the GPU (loss 1e-5, gradients 1e-4 relative, as on the CPU)
#  2. the NCCL communicator's conformance suite on one rank, with CPU tensors and with GPU tensors
#  3. the README main job with --device cuda (2 pipeline stages x 2 tensor-parallel shards as
#     threads sharing the GPU), which must reach the README's held-out accuracy; then a short
#     run with --backend nccl (one rank: one GPU cannot hold two NCCL ranks)
#  4. the GPT-2 124M step (vocabulary 50257, d 768, 12 layers, sequence 1024, batch
#     $PW_BENCH_BATCH, default 8), f32 and bf16, pipewright and PyTorch eager side by side,
#     MFU against the H100 SXM's dense peaks (989 TFLOP/s bf16, 67 f32)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu/out}
mkdir -p "$out"
for f in gpu/*.xz; do xz -dkf "$f" && chmod +x "${f%.xz}"; done
run() { bash tools/run-on-gpu.sh "$@"; }
check() { # NAME COMMAND...: runs it, logs to $out/NAME.log, says ok or FAILED
  local name=$1; shift
  if "$@" > "$out/$name.log" 2>&1; then echo "$name: ok"; else echo "$name: FAILED (exit $?)"; fi
  tail -n 4 "$out/$name.log"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
check parity env PW_TEST_DEVICE=cuda CARGO_MANIFEST_DIR="$PWD/crates/pipewright-models" \
  bash tools/run-on-gpu.sh gpu/gpt_parity --test-threads 1
check nccl env PW_TEST_DEVICE=cuda bash tools/run-on-gpu.sh gpu/nccl_probe
rm -rf runs/adder-gpu
check adder run gpu/pipewright train --model gpt --task adder --pp 2 --tp 2 --chunks 4 \
  --steps 1000 --device cuda --out runs/adder-gpu
rm -rf runs/adder-nccl
check nccl-train run gpu/pipewright train --model gpt --task adder --backend nccl --steps 200 \
  --device cuda --out runs/adder-nccl
export PW_BENCH_SIZE=gpt2 PW_BENCH_DEVICE=cuda PW_BENCH_BATCH=${PW_BENCH_BATCH:-8}
for p in f32 bf16; do
  peak=$([ $p = bf16 ] && echo 989 || echo 67)
  check "bench-pipewright-$p" env PW_BENCH_PRECISION=$p PW_BENCH_PEAK_TFLOPS=$peak \
    bash tools/run-on-gpu.sh gpu/gpt_step --bench
  check "bench-torch-$p" env PW_BENCH_PRECISION=$p PW_BENCH_PEAK_TFLOPS=$peak \
    python3 tools/bench_torch.py
done
