#!/usr/bin/env bash
# Issue 61's 200-step comparison against PyTorch: the fixture's Llama and GPT-2
# (crates/pipewright-cli/tests/fixtures/run_parity, tools/make_run_parity_fixture.sh) trained
# 200 steps of 8 x 32 tokens by PyTorch (tools/run_parity.py) and by pipewright on 1x1,
# pp 2 x dp 2 and dp 2 with ZeRO-3, with clipping and weight decay and without either; prints,
# per run, the largest relative difference of a step's loss from PyTorch's and the held-out
# perplexities. Needs the PyTorch venv ($PYTHON) and target/release/pipewright. Usage:
#   bash tools/run_parity_matrix.sh [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$HOME/.cache/pipewright-torch-env/bin/python}
P=$PWD/target/release/pipewright
F=crates/pipewright-cli/tests/fixtures/run_parity
steps=${1:-200}
w=$(mktemp -d)
trap 'rm -rf "$w"' EXIT
$P data windows --data $F/shards --block-size 32 --batch-size 8 --steps "$steps" --seed 0 \
  --out "$w/windows.csv" > /dev/null
common=(--lr 3e-3 --warmup 20 --beta2 0.95)
echo "| model | clip, weight decay | layout | worst step loss difference | held-out perplexity | PyTorch's |"
echo "| --- | --- | --- | ---: | ---: | ---: |"
for model in llama gpt2; do
  for opt in "1.0 0.1" "0 0"; do
    read -r clip wd <<< "$opt"
    "$PY" tools/run_parity.py "$F/$model" "$F/shards" "$w/windows.csv" "$w/torch.csv" \
      --block-size 32 "${common[@]}" --clip "$clip" --weight-decay "$wd" > /dev/null 2>&1
    for layout in "" "--pp 2 --dp 2 --chunks 2" "--dp 2 --zero 3"; do
      rm -rf "$w/pw"
      # shellcheck disable=SC2086
      $P train --model "$([ $model = gpt2 ] && echo gpt || echo llama)" --task tokens \
        --data $F/shards --init-from "$F/$model" --batch-size 8 --steps "$steps" \
        "${common[@]}" --clip "$clip" --weight-decay "$wd" --eval-every "$steps" \
        $layout --out "$w/pw" > /dev/null 2>&1
      python3 - "$w/pw/scalars.csv" "$w/torch.csv" "$model" "$clip, $wd" "${layout:-1x1}" <<'PY'
import csv, math, sys
pw = list(csv.DictReader(open(sys.argv[1])))
th = list(csv.DictReader(open(sys.argv[2])))
steps = {int(r["step"]): float(r["loss"]) for r in th if int(r["step"]) > 0}
worst = max(abs(float(r["loss"]) - steps[int(r["step"])]) / steps[int(r["step"])] for r in pw)
ppl = float(pw[-1]["metric"])
theirs = math.exp(next(float(r["loss"]) for r in th if int(r["step"]) == 0))
print(f"| {sys.argv[3]} | {sys.argv[4]} | {sys.argv[5]} | {worst:.1e} | {ppl:.4f} | {theirs:.4f} |")
PY
    done
  done
done
