#!/usr/bin/env bash
# The planner's predictions against measurement on this machine. Each of PW_PASSES passes
# (default 3) takes every layout in turn: it profiles the README's adder GPT with as many
# threads as each rank of the run will have, then at once `pipewright plan --candidate ...
# --measure` trains that layout for PW_STEPS steps (default 200) as threads, PW_REPEATS times
# (default 1). Each prediction comes from a profile taken seconds before its own measurement:
# this machine's speed moves in spells of half a second to minutes (identical 60-step runs in
# a row differ by 6-13 % in their median step, a whole run can be 30 % slow), so a profile
# taken once for a pass carries one moment's speed into measurements up to 10 s later
# (measured, passes alternated over the same four minutes: a profile per pass missed 10 % in
# 23 of 52 comparisons, a profile per layout in 11 of 52; BENCHMARKS.md's history). Prints, per layout,
# the median over passes of the predicted and measured step time and largest rank's allocated
# peak, each pass's error and their median: the verdict, as a pass's prediction is meant for
# its own measurement (the error of the two medians, also printed, sets one pass's prediction
# against another's measurement: passes of -1, -6 and -30 % gave -29.5 %). A run's median step
# over 200 steps (about 1.5 s) rides out the shorter spells that move one of 60 (0.4 s):
# identical pp 2 runs in a noisy phase, alternated, spread 7.3-9.3 ms over 60 steps and
# 7.3-8.0 over 240. Covers pp 1/2/4, tp 1/2, dp 1/2, four schedules and recompute on and off.
# PW_KEEP=DIR keeps every pass's profiles and runs in DIR (a new directory); PW_MEASURED=DIR
# then predicts those runs again from their own profiles with the code as it is now
# (`plan --measure --measured`: nothing is trained or profiled), so that a change to the
# planner is judged against the same measurements: on this machine two runs of the script
# differ by more than most changes do (2026-11-26: passes of one layout -38..+6 %).
# Not used by CI (timings).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p pipewright-cli
pw=target/release/pipewright
steps=${PW_STEPS:-200}
repeats=${PW_REPEATS:-1}
passes=${PW_PASSES:-3}
measured=
if [ -n "${PW_MEASURED:-}" ]; then
  dir=$PW_MEASURED
  measured=--measured
  passes=$(find "$dir" -maxdepth 1 -name 'pass*' -type d | wc -l)
  [ "$passes" -gt 0 ] || { echo "PW_MEASURED=$dir holds no kept passes (PW_KEEP)" >&2; exit 1; }
elif [ -n "${PW_KEEP:-}" ]; then
  [ ! -e "$PW_KEEP" ] || { echo "PW_KEEP=$PW_KEEP already exists: name a new directory" >&2; exit 1; }
  dir=$PW_KEEP
  mkdir -p "$dir"
else
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' EXIT
fi
log=$dir/log${measured:+-measured}
# A profile for a run of `world` ranks into the file $2. World 1: one rank with both
# cores. Worlds 2 and 4: one thread per rank, two ranks computing at once (one per core).
# Four copies on the two cores are no better for world 4: they run their rounds in near
# lockstep, so one layer can be preempted in most of its timings (measured here: one of two
# identical blocks' backward 2.2 times the other's), which no median removes. The world-4
# profile's tensor-parallel ranks sleep at once in their collectives, as a world of more
# ranks than cores does (they poll first in the world-2 profile, as two ranks on two cores do).
profile() {
  if [ "$1" = 1 ]; then
    $pw profile --sizes 4,8,16,32,64 --out "$2" >/dev/null
  else
    RAYON_NUM_THREADS=1 PIPEWRIGHT_COMM_SPIN_US=$([ "$1" -gt 2 ] && echo 0 || echo 50) \
      $pw profile --sizes 4,8,16,32,64 --tp-sizes 1,2 --concurrent 2 --out "$2" >/dev/null
  fi
}
# Each candidate of a `world`-rank run: a fresh profile, then its prediction and measurement
# (with PW_MEASURED, the kept profile and runs).
run() {
  local world=$1
  shift
  local n=0
  for c in "$@"; do
    n=$((n + 1))
    local out=$dir/pass$pass/w$world-$n
    mkdir -p "$dir/pass$pass"
    [ -n "$measured" ] || profile "$world" "$out.profile.json"
    $pw plan --world "$world" --nodes 1 --profile "$out.profile.json" --measure $measured \
      --steps "$steps" --repeats "$repeats" --out "$out" --candidate "$c"
  done
}
for pass in $(seq "$passes"); do
  run 1 mbs=16 mbs=16,recompute=always
  run 2 pp=2,mbs=16 pp=2,mbs=16,schedule=gpipe tp=2 dp=2 \
    pp=2,mbs=8,recompute=always pp=2,mbs=16,schedule=zb1
  run 4 pp=4,mbs=16 pp=2,tp=2,mbs=16 tp=2,dp=2 \
    pp=4,mbs=8,schedule=gpipe,recompute=always pp=2,dp=2,mbs=8,schedule=interleaved,virtual=2
done | tee "$log" >/dev/null
python3 - "$log" "$passes" <<'PY'
import re, statistics, sys
from collections import defaultdict
log, passes = open(sys.argv[1]).read().splitlines(), int(sys.argv[2])
def ms(v, unit):
    return float(v) * {"ms": 1.0, "s": 1e3, "us": 1e-3}[unit]
def mib(v, unit):
    return float(v) * {"KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}[unit]
rows, names, world = defaultdict(lambda: defaultdict(list)), {}, None
for line in log:
    if line.startswith("plan for "):
        world = int(line.split()[2])
    w = line.split()
    if len(w) > 9 and w[0].isdigit() and w[1].startswith("pp="):
        # rank, layout (pp tp dp [cp]), mbs, chunks, schedule (+ v), recompute, ...
        layout = " ".join(x for x in w[1:5] if "=" in x)
        rest = w[1 + len(layout.split()):]
        sched = rest[2] + (" " + rest[3] if rest[3].startswith("v") else "")
        rec = rest[4] if rest[3].startswith("v") else rest[3]
        names[w[0]] = (world, f"{layout} | {rest[0]} x {rest[1]} | {sched} | {rec}")
    m = re.match(r"^(\d+)\s+([\d.]+) (ms|s|us)\s+([\d.]+) (ms|s|us)\s+\S+\s+\S+ \S+\s+\S+ \S+\s+\S+\s+([\d.]+) (\w+)\s+([\d.]+) (\w+)", line)
    if m and m.group(1) in names:
        key = names[m.group(1)]
        rows[key]["step"].append((ms(m.group(2), m.group(3)), ms(m.group(4), m.group(5))))
        rows[key]["rank"].append((mib(m.group(6), m.group(7)), mib(m.group(8), m.group(9))))
print(f"{passes} passes; medians over passes: the predicted and measured values, each pass's")
print("error, their median (the verdict) and, for reference, the error of the two medians")
print("| world | layout | mbs x chunks | schedule | recompute | predicted | measured | error | passes | of medians | pred. rank | meas. rank | error |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
within, of_medians = [0, 0], 0
for (world, name), r in sorted(rows.items()):
    out = [str(world)] + [c.strip() for c in name.split("|")]
    for i, (kind, unit) in enumerate([("step", "ms"), ("rank", "MiB")]):
        p = statistics.median(a for a, _ in r[kind])
        q = statistics.median(b for _, b in r[kind])
        errs = [(a / b - 1) * 100 for a, b in r[kind]]
        err = statistics.median(errs)
        within[i] += abs(err) <= 10
        out += [f"{p:.1f} {unit}", f"{q:.1f} {unit}", f"{err:+.1f} %"]
        if kind == "step":
            mixed = (p / q - 1) * 100
            of_medians += abs(mixed) <= 10
            out += [" ".join(f"{e:+.0f}" for e in errs), f"{mixed:+.1f} %"]
    print("| " + " | ".join(out) + " |")
print(f"within 10 %: step time {within[0]} of {len(rows)}, allocated peak {within[1]} of {len(rows)}"
      f" (step time by the error of the medians: {of_medians} of {len(rows)})")
PY
