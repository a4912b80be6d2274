#!/usr/bin/env bash
# Times one GPT training step in pipewright (cargo bench) and in PyTorch eager, side by side in
# one run, and prints both medians and the ratio. Needs the venv of ../shared/tools/torch-env.sh
# with transformers (`$VENV/bin/pip install transformers`). Not used by CI.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TORCH_ENV:-$HOME/.cache/pipewright-torch-env}
log=$(mktemp)
cargo bench -q -p pipewright-models --bench gpt_step 2>/dev/null | tee "$log"
"$VENV/bin/python" tools/bench_torch.py 2>/dev/null | tee -a "$log"
pw=$(awk '/pipewright_median_ms/ {print $2}' "$log")
pt=$(awk '/torch_median_ms/ {print $2}' "$log")
rm -f "$log"
echo "pipewright ${pw} ms  torch ${pt} ms  ratio pipewright/torch $(python3 -c "print(round($pw/$pt, 2))")"
