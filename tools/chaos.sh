#!/usr/bin/env bash
# Chaos trials: `tools/chaos.sh N [SEED] [EVENTS]` runs N trials of a pp2 x tp2 GPT run (30 steps, a
# checkpoint every 5) under `pipewright launch` with 4 slots. In each, at a random step, one of:
#   kill   SIGKILL to a random rank (the launcher restarts the job from its newest checkpoint)
#   stop   SIGSTOP to a random rank (the heartbeat finds it hung; the attempt is restarted)
#   int    Ctrl-C (SIGINT) to the launcher (the ranks save and stop; a relaunch with
#          --resume latest finishes)
#   term   SIGTERM to the launcher (the same)
#   morph  the host file shrinks to 2 slots and a rank is killed, then grows back to 4 and a
#          rank is killed again (the attempts morph pp2 x tp2 -> 2 ranks -> pp2 x tp2)
#   damage a byte of the newest checkpoint is flipped and a rank killed (the restart passes
#          over that checkpoint, names it, and goes on from the one before)
# and the run must end as the uninterrupted one: bit-identical final parameters for the
# same-layout restarts, losses within 1e-5 for morphs; and scalars.csv must hold one whole row
# per step (1..30, every column). Prints a row per trial and the totals; exits non-zero when a
# trial fails. EVENTS (comma-separated) limits the draw to those events. BENCHMARKS.md records a
# 50-trial table; CI runs a few, and one damaged-newest trial.
set -uo pipefail
cd "$(dirname "$0")/.."
trials=${1:-5}
RANDOM=${2:-1}
cargo build -q --release -p pipewright-cli --features mpi || exit 1
bin=$PWD/target/pipewright-chaos
cp target/release/pipewright "$bin"
out=$PWD/target/chaos
rm -rf "$out"
mkdir -p "$out"
run=(train --n-layer 2 --n-head 4 --n-embd 64 --batch-size 32 --chunks 2 --dropout 0.1 --lr-schedule constant
  --eval-every 1000 --steps 30 --checkpoint-every 5 --pp 2 --tp 2)
"$bin" "${run[@]}" --out "$out/whole" >/dev/null || exit 1
"$bin" ckpt export "$out/whole/checkpoints" --format safetensors --out "$out/whole.safetensors" >/dev/null || exit 1

rows() { # steps recorded so far in run directory $1
  local n
  n=$(tail -n +2 "$1/scalars.csv" 2>/dev/null | wc -l)
  echo "${n:-0}"
}
wait_rows() { # run directory, rows: waits until it has that many (at most 2 minutes)
  for _ in $(seq 2400); do
    [ "$(rows "$1")" -ge "$2" ] && return 0
    sleep 0.05
  done
  return 1
}
ranks_of() { # launcher pid: the pids of the ranks of its current attempt
  local m
  m=$(pgrep -P "$1" mpirun | head -1)
  [ -n "$m" ] && pgrep -P "$m"
}
rank_of() { # launcher pid: the pid of a random rank of its current attempt
  ranks_of "$1" | shuf -n 1 --random-source=<(yes "$RANDOM")
}
wait_launcher() { # launcher pid: its exit status, or 124 after killing it when it runs past 10 minutes
  for _ in $(seq 6000); do
    kill -0 "$1" 2>/dev/null || break
    sleep 0.1
  done
  if kill -0 "$1" 2>/dev/null; then
    pkill -KILL -P "$1"
    kill -KILL "$1"
    wait "$1"
    return 124
  fi
  wait "$1"
}
whole_rows() { # run directory: rows 0..29 in order, each with 4 columns, the file ending in a newline
  local f=$1/scalars.csv
  [ "$(tail -c 1 "$f" | od -An -c | tr -d ' ')" = '\n' ] &&
    [ "$(tail -n +2 "$f" | cut -d, -f1 | tr '\n' ' ')" = "$(seq -s ' ' 1 30) " ] &&
    awk -F, 'NR > 1 && NF != 4 { bad = 1 } END { exit bad }' "$f"
}
same_params() { # run directory: final parameters bit-identical to the uninterrupted run's
  "$bin" ckpt export "$1/checkpoints" --format safetensors --out "$1.safetensors" >/dev/null &&
    cmp -s "$out/whole.safetensors" "$1.safetensors"
}
worst_loss() { # run directory: the largest relative loss difference to the uninterrupted run
  paste -d, <(cut -d, -f2 "$out/whole/scalars.csv") <(cut -d, -f2 "$1/scalars.csv") |
    awk -F, 'NR > 1 { d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > w) w = d } END { printf "%.1e", w }'
}

events=(kill stop int term morph damage)
[ -n "${3:-}" ] && IFS=, read -r -a events <<<"$3"
passed=0
failed=0
printf "%-5s %-6s %-5s %-8s %-5s %s\n" trial event step attempts exit result
for t in $(seq "$trials"); do
  ev=${events[$((RANDOM % ${#events[@]}))]}
  at=$((2 + RANDOM % 24))
  dir=$out/t$t
  hosts=$out/t$t.hosts
  echo "localhost slots=4" >"$hosts"
  timeout=300
  [ "$ev" = stop ] && timeout=6
  "$bin" launch --hostfile "$hosts" --max-restarts 3 --heartbeat-timeout "$timeout" -- \
    "$bin" "${run[@]}" --out "$dir" >"$dir.log" 2>&1 &
  launcher=$!
  damaged=
  why=
  # A run that never reaches the step fails the trial (the event would test nothing).
  wait_rows "$dir" "$at" || { why="no step $at in 2 minutes"; ev=none; }
  case $ev in
  kill) kill -KILL "$(rank_of "$launcher")" ;;
  stop) kill -STOP "$(rank_of "$launcher")" ;;
  int) kill -INT "$launcher" ;;
  term) kill -TERM "$launcher" ;;
  morph)
    echo "localhost slots=2" >"$hosts"
    kill -KILL "$(rank_of "$launcher")"
    sleep 1
    wait_rows "$dir" $((at + 2))
    echo "localhost slots=4" >"$hosts"
    kill -KILL "$(rank_of "$launcher")"
    ;;
  damage)
    # Two checkpoints at least (steps 5 and 10); the ranks are frozen, the newest gets a
    # flipped byte, and they are killed: no newer checkpoint can land after it.
    wait_rows "$dir" 11 || why="no step 11 in 2 minutes"
    ck=$dir/checkpoints
    mapfile -t pids < <(ranks_of "$launcher")
    kill -STOP "${pids[@]}"
    damaged=$(cat "$ck/latest")
    python3 -c 'import sys; p = sys.argv[1]; b = bytearray(open(p, "rb").read()); b[-9] ^= 16; open(p, "wb").write(b)' \
      "$(ls -S "$ck/$damaged"/*.safetensors | head -1)"
    kill -KILL "${pids[@]}"
    ;;
  esac
  wait_launcher "$launcher"
  code=$?
  if [ "$ev" = int ] || [ "$ev" = term ]; then
    # Saved and stopped (exit 0); a relaunch goes on from the checkpoint it saved.
    [ "$code" -eq 0 ] && "$bin" launch --hostfile "$hosts" -- "$bin" "${run[@]}" --resume latest --out "$dir" >>"$dir.log" 2>&1
    code=$?
  fi
  attempts=$(cat "$dir/launch.json" 2>/dev/null | grep -c '"attempt"')
  if [ "$ev" = morph ]; then
    worst=$(worst_loss "$dir")
    [ "$code" -eq 0 ] && whole_rows "$dir" && awk -v w="$worst" 'BEGIN { exit !(w < 1e-5) }'
    ok=$?
    result="losses within $worst"
  else
    [ "$code" -eq 0 ] && whole_rows "$dir" && same_params "$dir" &&
      { [ -z "$damaged" ] || grep -q "skipped $damaged" "$dir.log"; }
    ok=$?
    result="bit-identical"
    [ -n "$damaged" ] && result="bit-identical, $damaged skipped"
  fi
  [ -n "$why" ] && ok=1
  if [ "$ok" -eq 0 ]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    result="FAILED (${why:+$why; }see $dir.log)"
  fi
  printf "%-5s %-6s %-5s %-8s %-5s %s\n" "$t" "$ev" "$at" "$attempts" "$code" "$result"
done
echo "chaos: $passed passed, $failed failed of $trials trials"
[ "$failed" -eq 0 ]
