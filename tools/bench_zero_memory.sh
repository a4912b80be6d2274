#!/usr/bin/env bash
# ZeRO's memory and step time, measured side by side in one run: a 116M-parameter GPT trained
# for 3 steps under mpirun (one process per rank) at dp 1, 2 and 4 with ZeRO 0, 1, 2 and 3, each
# rank's allocated training peak (rank 0's, the replicas are alike) beside the planner's
# prediction for the same candidate, and the median step against plain dp at the same dp.
# Prints a markdown table (BENCHMARKS.md, "ZeRO"). About 11 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q --release -p pipewright-cli --features mpi
bin=target/pipewright-mpi
cp target/release/pipewright "$bin"
model=(--n-layer 12 --n-embd 896 --n-head 14)
out=target/bench-zero
rm -rf "$out"
mkdir -p "$out"
echo "| dp | ZeRO | measured peak / rank | predicted | predicted / measured | median step | vs ZeRO 0 |"
echo "|---:|---:|---:|---:|---:|---:|---:|"
for dp in 1 2 4; do
  base=""
  for zero in 0 1 2 3; do
    if [ "$dp" = 1 ] && [ "$zero" != 0 ]; then continue; fi
    run="$out/dp$dp-zero$zero"
    bash tools/mpirun.sh "$dp" "$bin" train "${model[@]}" --dp "$dp" --zero "$zero" \
      --batch-size "$dp" --steps 3 --eval-every 3 --backend mpi --out "$run" >/dev/null
    predicted=$("$bin" plan "${model[@]}" --world "$dp" --batch-size "$dp" --memory 1TiB \
      --candidate "dp=$dp,mbs=1,zero=$zero" | awk '$1 == "1" { print $(NF-1), $NF }')
    python3 - "$run/summary.json" "$predicted" "$dp" "$zero" "${base:-}" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
num, unit = sys.argv[2].split()
scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]
pred = float(num) * scale
meas = s["training_peak_allocated_bytes"]
step = s["median_step_seconds"]
base = float(sys.argv[5]) if sys.argv[5] else step
print(f"| {sys.argv[3]} | {sys.argv[4]} | {meas / 2**20:.0f} MiB | {pred / 2**20:.0f} MiB | "
      f"{pred / meas:.2f} | {step:.2f} s | {step / base:.2f} |")
PY
    if [ -z "$base" ]; then
      base=$(python3 -c "import json; print(json.load(open('$run/summary.json'))['median_step_seconds'])")
    fi
  done
done
