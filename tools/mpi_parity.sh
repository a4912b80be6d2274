#!/usr/bin/env bash
# A GPT run under mpirun -np NP must write the same losses and metrics as the same run on local
# threads. Usage: tools/mpi_parity.sh NP LAYOUT-FLAGS... (for example `2 --pp 2` or `2 --tp 2`).
# Prints a pass/fail line.
set -euo pipefail
cd "$(dirname "$0")/.."
np=$1
shift
cargo build -q --release -p pipewright-cli --features mpi
bin=target/pipewright-mpi
cp target/release/pipewright "$bin"
out=target/mpi-parity/$(echo "$*" | tr -c 'a-z0-9' '_')
rm -rf "$out"
args=(train --n-layer 2 --n-head 2 --n-embd 32 --batch-size 16 --chunks 4 --steps 6 --eval-every 3 --schedule 1f1b --dropout 0.1 "$@")
"$bin" "${args[@]}" --out "$out/local" >/dev/null
bash tools/mpirun.sh "$np" "$bin" "${args[@]}" --backend mpi --out "$out/mpi" >/dev/null
if diff <(cut -d, -f2,4 "$out/local/scalars.csv") <(cut -d, -f2,4 "$out/mpi/scalars.csv"); then
  echo "mpi parity ($*): GPT under mpirun -np $np writes the local run's losses and metrics ($(($(wc -l <"$out/mpi/scalars.csv") - 1)) rows)"
  echo "1 passed, 0 failed"
else
  echo "mpi parity ($*): losses differ"
  echo "0 passed, 1 failed"
  exit 1
fi
