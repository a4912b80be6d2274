#!/usr/bin/env bash
# The planner's predictions against measurement on this machine: profiles the README's adder
# GPT with as many threads as each rank of the run will have, then `pipewright plan
# --candidate ... --measure` trains each layout for PW_STEPS steps (default 60) as threads,
# PW_REPEATS times (default 3, the layouts in turn), and prints predicted and the median
# measured step time and training peak memory side by side. Covers pp
# 1/2/4, tp 1/2, dp 1/2, four schedules and recompute on and off. Not used by CI (timings).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p pipewright-cli
pw=target/release/pipewright
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
steps=${PW_STEPS:-60}
repeats=${PW_REPEATS:-3}
# world 1: one rank with both cores.
$pw profile --sizes 4,8,16,32,64 --out "$dir/p2.json" >/dev/null
# worlds 2 and 4: one thread per rank, two ranks computing at once (one per core).
RAYON_NUM_THREADS=1 $pw profile --sizes 4,8,16,32,64 --tp-sizes 1,2 --concurrent 2 \
  --out "$dir/p1.json" >/dev/null
run() {
  local world=$1 profile=$2
  shift 2
  local args=()
  for c in "$@"; do args+=(--candidate "$c"); done
  $pw plan --world "$world" --nodes 1 --profile "$profile" --measure --steps "$steps" --repeats "$repeats" \
    --out "$dir/w$world" "${args[@]}"
}
run 1 "$dir/p2.json" mbs=16 mbs=16,recompute=always
run 2 "$dir/p1.json" pp=2,mbs=16 pp=2,mbs=16,schedule=gpipe tp=2 dp=2 \
  pp=2,mbs=8,recompute=always pp=2,mbs=16,schedule=zb1
run 4 "$dir/p1.json" pp=4,mbs=16 pp=2,tp=2,mbs=16 tp=2,dp=2 \
  pp=4,mbs=8,schedule=gpipe,recompute=always pp=2,dp=2,mbs=8,schedule=interleaved,virtual=2
