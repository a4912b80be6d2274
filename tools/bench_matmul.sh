#!/usr/bin/env bash
# The matrix products of a benchmark GPT step, side by side in one run: candle's gemm with
# 2 threads and with 1 (RAYON_NUM_THREADS), PyTorch's MKL and NumPy's OpenBLAS with 2.
# Needs the venv of ../shared/tools/torch-env.sh. Not used by CI.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TORCH_ENV:-$HOME/.cache/pipewright-torch-env}
cargo bench -q -p pipewright-models --bench matmul --no-run 2>/dev/null
for t in 2 1; do
  echo "candle, $t thread(s):"
  RAYON_NUM_THREADS=$t cargo bench -q -p pipewright-models --bench matmul 2>/dev/null
done
"$VENV/bin/python" tools/bench_matmul.py 2>/dev/null
