#!/usr/bin/env bash
# An experiment relaunched under mpirun: the example experiment built with MPI, run with
# `--distributed --nproc-per-node 4 --pp 2`, relaunches itself as 4 processes that share one
# run directory; its losses must be those of the same run as 4 threads (a build without MPI).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
args=(--distributed --nproc-per-node 4 --pp 2 --chunks 2 --epochs 2)
cargo build -q --release -p pipewright --example experiment
cp target/release/examples/experiment "$out/threads"
cargo build -q --release -p pipewright --features mpi --example experiment
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
"$out/threads" --output-dir "$out/t" "${args[@]}" >/dev/null
target/release/examples/experiment --output-dir "$out/m" "${args[@]}" >/dev/null
runs=$(ls "$out/m/points" | wc -l)
python3 - "$out" "$runs" <<'PY'
import glob, json, sys
out, runs = sys.argv[1], int(sys.argv[2])
t = json.load(open(glob.glob(f"{out}/t/points/*/result.json")[0]))
m = json.load(open(glob.glob(f"{out}/m/points/*/result.json")[0]))
worst = max(abs(a - b) / abs(b) for a, b in zip(m["losses"], t["losses"]))
ok = runs == 1 and len(m["losses"]) == len(t["losses"]) == 16 and worst <= 1e-6
print(f"experiment under mpirun: 1 run directory: {runs == 1}, 16 steps, worst relative loss "
      f"difference to threads {worst:.1e}: {'ok' if ok else 'FAILED'}")
sys.exit(0 if ok else 1)
PY
