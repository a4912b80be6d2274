#!/usr/bin/env bash
# Times one GPT training step in pipewright (cargo bench) and in PyTorch eager, side by side in
# one run: PW_ROUNDS rounds (default 3), each running pipewright then PyTorch for
# PW_BENCH_STEPS timed steps (default 5) after a warm-up, so that a slow spell of the machine
# hits both sides. Prints each round's medians and ratio, then the median over rounds of each
# side and their ratio. Needs the venv of ../shared/tools/torch-env.sh with transformers
# (`$VENV/bin/pip install transformers`). Not used by CI.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TORCH_ENV:-$HOME/.cache/pipewright-torch-env}
cargo bench -q -p pipewright-models --bench gpt_step --no-run 2>/dev/null
pws=() pts=()
for round in $(seq "${PW_ROUNDS:-3}"); do
  pw=$(cargo bench -q -p pipewright-models --bench gpt_step 2>/dev/null | awk '/pipewright_median_ms/ {print $2}')
  pt=$("$VENV/bin/python" tools/bench_torch.py 2>/dev/null | awk '/torch_median_ms/ {print $2}')
  echo "round $round: pipewright ${pw} ms  torch ${pt} ms  ratio $(python3 -c "print(round($pw/$pt, 2))")"
  pws+=("$pw") pts+=("$pt")
done
python3 - "${pws[*]}" "${pts[*]}" <<'PY'
import statistics, sys
pw = statistics.median(map(float, sys.argv[1].split()))
pt = statistics.median(map(float, sys.argv[2].split()))
print(f"pipewright {pw:.1f} ms  torch {pt:.1f} ms  ratio pipewright/torch {pw / pt:.2f}")
PY
