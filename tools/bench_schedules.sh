#!/usr/bin/env bash
# The pipeline schedules on this machine, side by side: for each schedule, a traced run of a GPT
# (6 blocks, d 128, 8 micro-batches of 4 rows) at pp 2 (one rank per core) and pp 4, then
# `pipewright schedule --trace` on it: the last step's length, its measured idle share (between
# actions and waiting inside them) and the idle share of its own schedule simulated with the
# step's measured costs. REPEATS rounds (default 3), the schedules interleaved in each. Prints a
# Markdown table row per run (BENCHMARKS.md, "V schedules").
set -euo pipefail
cd "$(dirname "$0")/.."
repeats=${1:-3}
cargo build -q --release -p pipewright-cli
bin=target/release/pipewright
out=target/bench-schedules
rm -rf "$out"
mkdir -p "$out"
echo "| round | pp | schedule | step ms | measured idle | simulated idle |"
echo "|---|---|---|---|---|---|"
for round in $(seq 1 "$repeats"); do
  for pp in 2 4; do
    for s in 1f1b zb1 zbv dualpipev; do
      dir=$out/$round-$pp-$s
      "$bin" train --pp "$pp" --chunks 8 --schedule "$s" --n-layer 6 --n-embd 128 --n-head 4 \
        --batch-size 32 --steps 4 --trace "$dir.json" --out "$dir" >/dev/null
      text=$("$bin" schedule --trace "$dir.json")
      ms=$(echo "$text" | sed -n 's/^measured step.*pipeline \([0-9.]*\) ms.*/\1/p')
      measured=$(echo "$text" | sed -n 's/^measured step.*idle \([0-9.]*\) %.*/\1/p')
      simulated=$(echo "$text" | sed -n 's/^its schedule simulated.*idle \([0-9.]*\) %.*/\1/p')
      echo "| $round | $pp | $s | $ms | $measured % | $simulated % |"
    done
  done
done
