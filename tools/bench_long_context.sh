#!/usr/bin/env bash
# Long sequences, measured side by side in one run: a small GPT (2 layers, 2 heads, width 64,
# byte-level text) trained for 3 steps on one sequence per step of 1k to 16k tokens under
# mpirun (one process per rank) at cp 1, 2 and 4 and at tp 2 with and without sequence
# parallelism; rank 0's allocated training peak (the ranks are alike) and the median step,
# beside the planner's prediction for the same candidate (the GPT's shapes on cpu-2core).
# Prints a markdown table (BENCHMARKS.md, "Long sequences"). About 6 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q --release -p pipewright-cli --features mpi
bin=target/pipewright-mpi
cp target/release/pipewright "$bin"
out=target/bench-long-context
rm -rf "$out"
mkdir -p "$out"
# A text of 1.1 MB (words drawn with a fixed seed): every run reads the same bytes.
python3 - "$out/text.txt" <<'PY'
import random, sys
random.seed(0)
words = "the model ring attention sequence token parallel long context of and to a in".split()
open(sys.argv[1], "w").write(" ".join(random.choice(words) for _ in range(200000)))
PY
model=(--task text --data "$out/text.txt" --n-layer 2 --n-head 2 --n-embd 64 --batch-size 1)
echo "| tokens | layout | measured peak / rank | predicted | predicted / measured | vs cp 1 | median step | predicted step |"
echo "|---:|:---|---:|---:|---:|---:|---:|---:|"
for seq in 1024 2048 4096 8192 16384; do
  base=""
  for spec in "cp=1" "cp=2" "cp=4" "tp=2" "tp=2,sp=1"; do
    cp=1 tp=1 sp=""
    case "$spec" in *cp=*) cp=${spec#cp=} ;; esac
    case "$spec" in tp=2*) tp=2 ;; esac
    case "$spec" in *sp=1) sp=--sequence-parallel ;; esac
    world=$((cp * tp))
    run="$out/$seq-${spec//[=,]/-}"
    bash tools/mpirun.sh "$world" "$bin" train "${model[@]}" --block-size "$seq" --cp "$cp" \
      --tp "$tp" $sp --steps 3 --eval-every 3 --backend mpi --out "$run" >/dev/null
    predicted=$("$bin" plan "${model[@]}" --block-size "$seq" --world "$world" --memory 1TiB \
      --candidate "$spec" | awk '$1 == "1" { print $(NF-4), $(NF-3), $(NF-1), $NF }')
    line=$(python3 - "$run/summary.json" "$predicted" "$seq" "$spec" "${base:-}" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
step_num, step_unit, num, unit = sys.argv[2].split()
scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
pred = float(num) * scale
pred_step = float(step_num) * {"s": 1.0, "ms": 1e-3}[step_unit]
meas = s["training_peak_allocated_bytes"]
base = float(sys.argv[5]) if sys.argv[5] else meas
layout = sys.argv[4].replace("=", " ").replace(",sp 1", " + SP")
print(f"| {int(sys.argv[3]):,} | {layout} | {meas / 2**20:.1f} MiB | {pred / 2**20:.1f} MiB | "
      f"{pred / meas:.2f} | {meas / base:.2f} | {s['median_step_seconds']:.3f} s | {pred_step:.3f} s |")
PY
    )
    echo "$line"
    if [ -z "$base" ]; then
      base=$(python3 -c "import json; print(json.load(open('$run/summary.json'))['training_peak_allocated_bytes'])")
    fi
  done
done
