#!/usr/bin/env bash
# A 2-stage GPT pipeline under mpirun -np 2 must write the same losses as the same run on
# local threads. Prints a pass/fail line.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q --release -p pipewright-cli --features mpi
bin=target/pipewright-mpi
cp target/release/pipewright "$bin"
out=target/mpi-pipeline-parity
rm -rf "$out"
args=(train --n-layer 2 --n-head 2 --n-embd 32 --batch-size 16 --chunks 4 --steps 6 --eval-every 3 --pp 2 --schedule 1f1b --dropout 0.1)
"$bin" "${args[@]}" --out "$out/local" >/dev/null
bash tools/mpirun.sh 2 "$bin" "${args[@]}" --backend mpi --out "$out/mpi" >/dev/null
if diff <(cut -d, -f2,4 "$out/local/scalars.csv") <(cut -d, -f2,4 "$out/mpi/scalars.csv"); then
  echo "mpi pipeline parity: 2-stage GPT under mpirun writes the local run's losses and metrics ($(($(wc -l <"$out/mpi/scalars.csv") - 1)) rows)"
  echo "1 passed, 0 failed"
else
  echo "mpi pipeline parity: losses differ"
  echo "0 passed, 1 failed"
  exit 1
fi
