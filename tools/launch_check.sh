#!/usr/bin/env bash
# `pipewright launch` under Open MPI on this machine:
# 1. 4 ranks of `pipewright train --pp 2 --tp 2` write the losses of the same run on threads;
# 2. a rank killed with SIGKILL once the step-10 checkpoint is written: the launcher restarts
#    the job, which goes on from its newest checkpoint; exit 0, two attempts, one scalars row
#    per step, and the final parameters bit-identical to an uninterrupted run's;
# 3. a rank that always fails with --max-restarts 1: non-zero exit naming both attempts;
# 4. SIGTERM to the launcher: the ranks save the step they are at and exit 0; a relaunch with
#    --resume latest ends bit-identical to the uninterrupted run;
# 5. a rank stopped with SIGSTOP: found by the heartbeat, the attempt ended and restarted;
# 6. the host file shrinks from 4 slots to 2 after a kill and grows back after another: the
#    attempts morph the layout and the 30 losses stay within 1e-5 of the uninterrupted run's;
# 7. two machines simulated on this one (../shared/MULTINODE.md): ranks see NODE_RANK 0 and 1
#    and train to the threads run's losses;
# 8. --hosts in Open MPI's syntax: its slots make the world;
# 9. a Llama whose host file shrinks from 4 slots to 2 after a kill: its restarted attempt is
#    morphed by the planner from the Llama's shapes (not to the nearest layout) and its 20
#    losses stay within 1e-5 of the uninterrupted run's.
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
# Waits until the run in $1 has a checkpoint of step $2 or later.
wait_for_step() {
  for _ in $(seq 1200); do
    local l
    l=$(cat "$1/checkpoints/latest" 2>/dev/null | sed 's/step-0*//')
    [ -n "$l" ] && [ "$l" -ge "$2" ] && return 0
    sleep 0.05
  done
  return 1
}

small=(train --n-layer 2 --n-head 2 --n-embd 32 --batch-size 16 --chunks 2 --dropout 0.1 --lr-schedule constant --eval-every 1000)

# 1. Same losses as the threads run (both runs ended well: two runs that both failed early
# would write the same few rows).
"$bin" "${small[@]}" --pp 2 --tp 2 --steps 8 --out "$out/threads" >/dev/null
threads=$?
"$bin" launch --nproc-per-node 4 -- "$bin" "${small[@]}" --pp 2 --tp 2 --steps 8 --out "$out/launched" >/dev/null 2>&1
code=$?
rows=$(($(wc -l <"$out/launched/scalars.csv") - 1))
[ "$threads" -eq 0 ] && [ "$code" -eq 0 ] && [ "$rows" -eq 8 ] &&
  diff -q <(cut -d, -f1-3 "$out/threads/scalars.csv") <(cut -d, -f1-3 "$out/launched/scalars.csv") >/dev/null
check "4 ranks under the launcher write the threads run's losses (exits $threads and $code, $rows rows)" $?

# 2. Kill a rank after the step-10 checkpoint; the restart finishes the run bit for bit.
big=(train --n-layer 2 --n-head 4 --n-embd 128 --batch-size 64 --chunks 2 --dropout 0.1 --lr-schedule constant
  --eval-every 1000 --steps 30 --checkpoint-every 5 --pp 2 --tp 2)
"$bin" "${big[@]}" --out "$out/whole" >/dev/null || echo "launch: the uninterrupted run failed (exit $?): the checks against it fail"
"$bin" launch --nproc-per-node 4 --max-restarts 2 -- "$bin" "${big[@]}" --out "$out/killed" >"$out/killed.log" 2>&1 &
launcher=$!
# (At step 10 or later: polling for exactly step 10 could miss it on a fast machine, and then
# kill no rank at all.)
wait_for_step "$out/killed" 10
mpirun_pid=$(pgrep -P "$launcher" mpirun | head -1)
victim=$(pgrep -P "${mpirun_pid:-0}" | tail -1)
[ -n "$victim" ] && kill -9 "$victim"
wait "$launcher"
code=$?
attempts=$(grep -c '"attempt"' "$out/killed/launch.json")
steps=$(cut -d, -f1 "$out/killed/scalars.csv" | tail -n +2 | tr '\n' ' ')
"$bin" ckpt export "$out/whole/checkpoints" --format safetensors --out "$out/whole.safetensors" >/dev/null
"$bin" ckpt export "$out/killed/checkpoints" --format safetensors --out "$out/killed.safetensors" >/dev/null
cmp -s "$out/whole.safetensors" "$out/killed.safetensors"
same=$?
[ -n "$victim" ] && [ "$code" -eq 0 ] && [ "$attempts" -eq 2 ] && [ "$steps" = "$(seq -s ' ' 1 30) " ] && [ "$same" -eq 0 ]
# (Its status first: a command substitution in check's arguments would set $? before it is read.)
ok=$?
check "a rank killed after step 10 (exit $code, $attempts attempts, final parameters identical: $([ $same -eq 0 ] && echo yes || echo no))" $ok

# The largest relative difference of run $2's losses from run $1's (1 unless it has $3 rows).
worst_loss() {
  paste -d, <(cut -d, -f2 "$1/scalars.csv") <(cut -d, -f2 "$2/scalars.csv") |
    awk -F, -v n="$3" 'NR > 1 { d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > w) w = d; k++ } END { if (k != n) w = 1; printf "%.2e", w }'
}
# The world of each attempt of the launch in run directory $1.
worlds_of() { grep '"world"' "$1/launch.json" | tr -dc '0-9\n' | tr '\n' ' '; }
# Kills (signal $2) one rank of the launcher $1's current attempt.
signal_rank() {
  local m
  m=$(pgrep -P "$1" mpirun | head -1)
  kill "-$2" "$(pgrep -P "$m" | tail -1)"
}
same_as_whole() { # run directory: its final parameters equal the uninterrupted run's
  "$bin" ckpt export "$1/checkpoints" --format safetensors --out "$1.safetensors" >/dev/null &&
    cmp -s "$out/whole.safetensors" "$1.safetensors"
}

# 3. A rank that always fails: both attempts named, non-zero exit.
msg=$("$bin" launch --nproc-per-node 2 --max-restarts 1 --run-dir "$out/failing" -- sh -c 'test "$RANK" != 1' 2>&1)
code=$?
[ "$code" -ne 0 ] && grep -q "attempt 0 (2 ranks)" <<<"$msg" && grep -q "attempt 1 (2 ranks)" <<<"$msg"
check "a rank that always fails ends the launch after --max-restarts 1" $?

# 4. Preemption.
"$bin" launch --nproc-per-node 4 -- "$bin" "${big[@]}" --out "$out/pre" >"$out/pre.log" 2>&1 &
launcher=$!
wait_for_step "$out/pre" 10
kill -TERM "$launcher"
wait "$launcher"
code=$?
saved=$(sed 's/step-0*//' "$out/pre/checkpoints/latest")
grep -q '"preempted: saved and stopped"' "$out/pre/launch.json"
noted=$?
"$bin" launch --nproc-per-node 4 -- "$bin" "${big[@]}" --resume latest --out "$out/pre" >>"$out/pre.log" 2>&1
again=$?
[ "$code" -eq 0 ] && [ "$noted" -eq 0 ] && [ "$again" -eq 0 ] && same_as_whole "$out/pre"
check "SIGTERM to the launcher: saved step $saved, exit $code; the relaunch ends bit for bit" $?

# 5. A hung rank.
"$bin" launch --nproc-per-node 4 --heartbeat-timeout 8 --max-restarts 1 -- "$bin" "${big[@]}" --out "$out/hang" >"$out/hang.log" 2>&1 &
launcher=$!
wait_for_step "$out/hang" 10
signal_rank "$launcher" STOP
wait "$launcher"
code=$?
grep -q '"heartbeat: rank' "$out/hang/launch.json"
found=$?
[ "$code" -eq 0 ] && [ "$found" -eq 0 ] && same_as_whole "$out/hang"
check "a rank stopped with SIGSTOP is found by the heartbeat, restarted, and the run ends bit for bit" $?

# 6. Shrink and grow.
hosts=$out/hostfile
echo "localhost slots=4" >"$hosts"
"$bin" launch --hostfile "$hosts" --max-restarts 3 -- "$bin" "${big[@]}" --out "$out/morph" >"$out/morph.log" 2>&1 &
launcher=$!
wait_for_step "$out/morph" 10
echo "localhost slots=2" >"$hosts"
signal_rank "$launcher" KILL
sleep 1
wait_for_step "$out/morph" 20
echo "localhost slots=4" >"$hosts"
signal_rank "$launcher" KILL
wait "$launcher"
code=$?
worlds=$(worlds_of "$out/morph")
worst=$(worst_loss "$out/whole" "$out/morph" 30)
[ "$code" -eq 0 ] && [ "$worlds" = "4 2 4 " ] && awk -v w="$worst" 'BEGIN { exit !(w < 1e-5) }'
check "4 -> 2 -> 4 slots (worlds: $worlds): 30 losses within $worst of the uninterrupted run" $?

# 7. Two machines simulated on this one.
grep -q ' nodea$' /etc/hosts || echo "127.0.0.2 nodea" >>/etc/hosts
grep -q ' nodeb$' /etc/hosts || echo "127.0.0.3 nodeb" >>/etc/hosts
printf 'nodea slots=2\nnodeb slots=2\n' >"$out/two-nodes"
fake=$(cd ../shared/tools && pwd)/fake-ssh
net=(--mpirun-arg=--mca --mpirun-arg=plm_rsh_agent "--mpirun-arg=$fake" --mpirun-arg=--mca --mpirun-arg=rtc
  --mpirun-arg=^hwloc --mpirun-arg=--mca --mpirun-arg=btl --mpirun-arg=tcp,self --mpirun-arg=--mca
  --mpirun-arg=btl_tcp_if_include --mpirun-arg=lo --mpirun-arg=--mca --mpirun-arg=oob_tcp_if_include --mpirun-arg=lo)
nodes=$("$bin" launch --hostfile "$out/two-nodes" "${net[@]}" --run-dir "$out/nodes" -- sh -c 'echo "node $NODE_RANK"' 2>/dev/null | sort -u | tr '\n' ' ')
"$bin" launch --hostfile "$out/two-nodes" "${net[@]}" -- "$bin" "${small[@]}" --pp 2 --tp 2 --steps 8 --out "$out/two" >"$out/two.log" 2>&1
code=$?
[ "$code" -eq 0 ] && [ "$nodes" = "node 0 node 1 " ] &&
  diff -q <(cut -d, -f1-3 "$out/threads/scalars.csv") <(cut -d, -f1-3 "$out/two/scalars.csv") >/dev/null
two=$?
check "two simulated machines ($nodes): the threads run's losses" $two
# (Once failed in CI and never here: a failure shows what the launch said and where the
# losses part.)
if [ "$two" -ne 0 ]; then
  echo "launch exit $code; the launch's last lines:" && tail -25 "$out/two.log"
  diff <(cut -d, -f1-3 "$out/threads/scalars.csv") <(cut -d, -f1-3 "$out/two/scalars.csv") | head -20
fi

# 8. --hosts.
ranks=$("$bin" launch --hosts localhost:3 --run-dir "$out/hosts" -- sh -c 'echo "$RANK/$WORLD_SIZE"' 2>/dev/null | sort | tr '\n' ' ')
[ "$ranks" = "0/3 1/3 2/3 " ]
check "--hosts localhost:3 starts ranks $ranks" $?

# 9. A Llama restarted in a smaller world: planned from its shapes.
llama=(train --model llama --n-layer 2 --n-head 4 --n-kv-head 2 --n-embd 64 --batch-size 16 --chunks 2
  --lr-schedule constant --eval-every 1000 --steps 20 --checkpoint-every 5 --pp 2 --tp 2)
"$bin" "${llama[@]}" --out "$out/llama-whole" >/dev/null || echo "launch: the uninterrupted Llama run failed (exit $?)"
echo "localhost slots=4" >"$out/llama-hosts"
"$bin" launch --hostfile "$out/llama-hosts" --max-restarts 2 -- "$bin" "${llama[@]}" --out "$out/llama" >"$out/llama.log" 2>&1 &
launcher=$!
wait_for_step "$out/llama" 10
echo "localhost slots=2" >"$out/llama-hosts"
signal_rank "$launcher" KILL
wait "$launcher"
code=$?
worlds=$(worlds_of "$out/llama")
grep -q "morphing from pp=2 tp=2 dp=1 to .* for a world of 2 (the planner's fastest" "$out/llama.log"
planned=$?
worst=$(worst_loss "$out/llama-whole" "$out/llama" 20)
[ "$code" -eq 0 ] && [ "$worlds" = "4 2 " ] && [ "$planned" -eq 0 ] && awk -v w="$worst" 'BEGIN { exit !(w < 1e-5) }'
check "a Llama on 4 -> 2 slots (worlds: $worlds) is morphed by the planner: 20 losses within $worst" $?

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
