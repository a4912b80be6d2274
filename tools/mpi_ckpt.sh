#!/usr/bin/env bash
# A checkpoint saved under mpirun -np 4 (--tp 2 --dp 2) and resumed by a fresh mpirun must give
# the losses of the same run on local threads without interruption, bit for bit.
# Prints a pass/fail line.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build -q --release -p pipewright-cli --features mpi
bin=target/pipewright-mpi
cp target/release/pipewright "$bin"
out=target/mpi-ckpt
rm -rf "$out"
args=(train --n-layer 2 --n-head 2 --n-embd 32 --batch-size 16 --chunks 2 --tp 2 --dp 2 --dropout 0.1
  --lr-schedule constant --eval-every 1000)
"$bin" "${args[@]}" --steps 12 --out "$out/local" >/dev/null
bash tools/mpirun.sh 4 "$bin" "${args[@]}" --backend mpi --steps 6 --checkpoint-every 6 --out "$out/mpi" >/dev/null
bash tools/mpirun.sh 4 "$bin" "${args[@]}" --backend mpi --steps 12 --resume latest --out "$out/mpi" >/dev/null
if diff <(cut -d, -f1-3 "$out/local/scalars.csv") <(cut -d, -f1-3 "$out/mpi/scalars.csv"); then
  echo "mpi checkpoint: saved and resumed under mpirun -np 4, the losses of 12 uninterrupted steps on threads, bit for bit"
  echo "1 passed, 0 failed"
else
  echo "mpi checkpoint: the resumed run's losses differ from the uninterrupted run's"
  echo "0 passed, 1 failed"
  exit 1
fi
