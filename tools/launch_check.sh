#!/usr/bin/env bash
# `pipewright launch` under Open MPI on this machine:
# 1. 4 ranks of `pipewright train --pp 2 --tp 2` write the losses of the same run on threads;
# 2. a rank killed with SIGKILL after the step-10 checkpoint: the launcher restarts the job,
#    which goes on from its newest checkpoint; exit 0, one scalars row per step, and the final
#    parameters bit-identical to an uninterrupted run's;
# 3. a rank that always fails with --max-restarts 1: non-zero exit naming both attempts.
# Prints a pass/fail line per check.
set -uo pipefail
cd "$(dirname "$0")/.."
cargo build -q --release -p pipewright-cli --features mpi || exit 1
bin=$PWD/target/pipewright-mpi
cp target/release/pipewright "$bin"
out=$PWD/target/launch-check
rm -rf "$out"
passed=0
failed=0
check() { # name, condition result
  if [ "$2" -eq 0 ]; then echo "launch: $1: ok"; passed=$((passed + 1)); else echo "launch: $1: FAILED"; failed=$((failed + 1)); fi
}
small=(train --n-layer 2 --n-head 2 --n-embd 32 --batch-size 16 --chunks 2 --dropout 0.1 --lr-schedule constant --eval-every 1000)

# 1. Same losses as the threads run.
"$bin" "${small[@]}" --pp 2 --tp 2 --steps 8 --out "$out/threads" >/dev/null
"$bin" launch --nproc-per-node 4 -- "$bin" "${small[@]}" --pp 2 --tp 2 --steps 8 --out "$out/launched" >/dev/null 2>&1
diff -q <(cut -d, -f1-3 "$out/threads/scalars.csv") <(cut -d, -f1-3 "$out/launched/scalars.csv") >/dev/null
check "4 ranks under the launcher write the threads run's losses" $?

# 2. Kill a rank after the step-10 checkpoint; the restart finishes the run bit for bit.
big=(train --n-layer 2 --n-head 4 --n-embd 128 --batch-size 64 --chunks 2 --dropout 0.1 --lr-schedule constant
  --eval-every 1000 --steps 30 --checkpoint-every 5 --pp 2 --tp 2)
"$bin" "${big[@]}" --out "$out/whole" >/dev/null
"$bin" launch --nproc-per-node 4 --max-restarts 2 -- "$bin" "${big[@]}" --out "$out/killed" >"$out/killed.log" 2>&1 &
launcher=$!
for _ in $(seq 600); do
  [ "$(cat "$out/killed/checkpoints/latest" 2>/dev/null)" = step-00000010 ] && break
  sleep 0.1
done
mpirun_pid=$(pgrep -P "$launcher" mpirun | head -1)
victim=$(pgrep -P "$mpirun_pid" | tail -1)
kill -9 "$victim"
wait "$launcher"
code=$?
attempts=$(grep -c '"attempt"' "$out/killed/launch.json")
steps=$(cut -d, -f1 "$out/killed/scalars.csv" | tail -n +2 | tr '\n' ' ')
"$bin" ckpt export "$out/whole/checkpoints" --format safetensors --out "$out/whole.safetensors" >/dev/null
"$bin" ckpt export "$out/killed/checkpoints" --format safetensors --out "$out/killed.safetensors" >/dev/null
cmp -s "$out/whole.safetensors" "$out/killed.safetensors"
same=$?
[ "$code" -eq 0 ] && [ "$attempts" -eq 2 ] && [ "$steps" = "$(seq -s ' ' 0 29) " ] && [ "$same" -eq 0 ]
check "a rank killed after step 10 (exit $code, $attempts attempts, final parameters identical: $([ $same -eq 0 ] && echo yes || echo no))" $?

# 3. A rank that always fails: both attempts named, non-zero exit.
msg=$("$bin" launch --nproc-per-node 2 --max-restarts 1 --run-dir "$out/failing" -- sh -c 'test "$RANK" != 1' 2>&1)
code=$?
[ "$code" -ne 0 ] && grep -q "attempt 0 (2 ranks)" <<<"$msg" && grep -q "attempt 1 (2 ranks)" <<<"$msg"
check "a rank that always fails ends the launch after --max-restarts 1" $?

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
