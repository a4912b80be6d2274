#!/usr/bin/env bash
# A rank that dies under MPI must end the whole job within a bounded time, with a message that
# names it, instead of leaving the other ranks waiting. Prints a pass/fail line.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
out=$(PIPEWRIGHT_DIE_RANK=1 timeout 60 bash tools/mpirun.sh 2 -x PIPEWRIGHT_DIE_RANK target/release/examples/mpi_check 2>&1)
code=$?
secs=$(( $(date +%s) - start ))
if [ $code -ne 0 ] && [ $code -ne 124 ] && grep -q "rank 1" <<<"$out"; then
  echo "mpi peer death: job ended in ${secs}s with exit $code, naming rank 1"
  echo "1 passed, 0 failed"
else
  echo "$out"
  echo "mpi peer death: exit $code after ${secs}s (124 = still hanging at 60s)"
  echo "0 passed, 1 failed"
  exit 1
fi
