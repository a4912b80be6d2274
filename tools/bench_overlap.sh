#!/usr/bin/env bash
# Issue 72's overlap benchmark: data parallelism over two simulated machines joined by a link
# whose time is not CPU time. Loopback TCP moves the bench model's gradients in about 0.1 s of
# kernel copying on the same cores that compute, so overlap there hides little; here the second
# machine is a network namespace joined to the first by a veth pair shaped to 1 Gbit/s with
# `tc ... tbf` (netem's module is missing on these machines), each end with an address of its
# own, and Open MPI's second daemon starts inside the second namespace through an rsh agent
# that runs it with `ip netns exec` (../shared/MULTINODE.md). Needs root; the namespaces, the
# link and the agent are removed at the end, whatever happens.
#
#   tools/bench_overlap.sh              dp 2 of the GPT bench model (d 512, 4 layers, vocabulary
#                                       4096) at blocks of 256 and 64 tokens, overlap on and
#                                       --no-overlap alternating, $PW_ROUNDS rounds (default 3)
#
# Prints per run and then per case the median step time and rank 0's exposed communication
# (summary.json's exposed_comm_per_rank: the median step's time waited on the gradient sums,
# ZeRO's reduce-scatters and gathers) and the ratios overlap / --no-overlap. PW_BIN names the binary (default: built here with
# --features mpi); PW_BLOCKS the blocks; PW_TRAIN extra train flags (--zero 2, say).
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" -eq 0 ] || { echo "bench_overlap: needs root (network namespaces)" >&2; exit 1; }
command -v mpirun >/dev/null || bash tools/install-mpi.sh
bin=${PW_BIN:-target/release/pipewright}
if [ -z "${PW_BIN:-}" ]; then
  cargo build --release -q -p pipewright-cli --features mpi
fi
out=$(realpath -m "${PW_OUT:-target/bench-overlap}")
rm -rf "$out" && mkdir -p "$out"
a=pw-node-a b=pw-node-b
teardown() {
  ip netns del $a 2>/dev/null || true
  ip netns del $b 2>/dev/null || true
}
trap teardown EXIT
teardown
ip netns add $a
ip netns add $b
ip link add pw-veth-a type veth peer name pw-veth-b
ip link set pw-veth-a netns $a
ip link set pw-veth-b netns $b
for n in a b; do
  ns=pw-node-$n
  addr=$([ $n = a ] && echo 10.77.0.1 || echo 10.77.0.2)
  ip -n $ns addr add $addr/24 dev pw-veth-$n
  ip -n $ns link set pw-veth-$n up
  ip -n $ns link set lo up
  tc -n $ns qdisc add dev pw-veth-$n root tbf rate 1gbit burst 256kb latency 50ms
done
# The rsh agent: drops ssh's options and the host name, runs the daemon in the second machine.
cat >"$out/agent" <<EOF
#!/bin/sh
while [ \$# -gt 0 ]; do case "\$1" in -x|-l|-p|-o) shift 2;; -*) shift;; *) break;; esac; done
shift
exec ip netns exec $b /bin/sh -c "\$*"
EOF
chmod +x "$out/agent"
printf '10.77.0.1 slots=1\n10.77.0.2 slots=1\n' >"$out/hosts"
mpi=(env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun -np 2 --hostfile "$out/hosts"
  --mca plm_rsh_agent "$out/agent" --mca rtc ^hwloc --mca btl tcp,self
  --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24
  --mca mpi_yield_when_idle 1 -x RAYON_NUM_THREADS=1)
# The planner's machines for the runs' own predictions: this machine's description with the
# link between the two "nodes" as pipewright's all-reduce measures it there (`bench comm`'s
# fit of latency + bytes / bandwidth at 2 ranks, the shaped link's MPI goodput).
ip netns exec $a "${mpi[@]}" "$(realpath "$bin")" bench comm --backend mpi --sizes 0.01,16 \
  --iters 3 --out "$out/link.json" >"$out/link.log" 2>&1 ||
  { echo "bench_overlap: bench comm failed:"; tail -20 "$out/link.log"; exit 1; }
# Each node's rank computes on one of the machine's two cores (RAYON_NUM_THREADS=1): its matrix
# products timed on one thread, as the runs compute them.
RAYON_NUM_THREADS=1 "$bin" profile --gemm --hardware crates/pipewright/hardware/cpu-2core.json \
  --out "$out/node.json" >"$out/node.log" 2>&1 ||
  { echo "bench_overlap: profile --gemm failed:"; tail -20 "$out/node.log"; exit 1; }
python3 - "$out/link.json" "$out/hardware.json" "$out/node.json" <<'PY'
import json, sys
link = json.load(open(sys.argv[1]))["all_reduce"]
hw = json.load(open(sys.argv[3]))
hw["name"] = "one core of cpu-2core a node, two nodes joined by a veth pair shaped to 1 Gbit/s (tools/bench_overlap.sh)"
hw["cores_per_device"] = 1
hw["inter_node"] = {"latency_s": link["latency_s"], "bandwidth_bytes_per_s": link["bandwidth_bytes_per_s"]}
json.dump(hw, open(sys.argv[2], "w"))
print(f"the link: {link['latency_s'] * 1e6:.0f} us + bytes / {link['bandwidth_bytes_per_s'] / 1e6:.0f} MB/s (all-reduce at 2 ranks)")
PY
run() { # NAME BLOCK FLAGS...: one training run across the two machines
  local name=$1 block=$2
  shift 2
  ip netns exec $a "${mpi[@]}" "$(realpath "$bin")" train --model gpt --task text \
    --data "$PWD/README.md" --vocab-size 4096 --block-size "$block" --n-layer 4 --n-head 8 \
    --n-embd 512 --batch-size 16 --chunks 1 --dp 2 --backend mpi --steps "${PW_STEPS:-6}" \
    --eval-every 1000 --log-every 1000 --hardware "$out/hardware.json" --out "$out/$name" \
    ${PW_TRAIN:-} "$@" \
    >"$out/$name.log" 2>&1 || { echo "bench_overlap: $name failed:"; tail -20 "$out/$name.log"; exit 1; }
  python3 - "$out/$name/summary.json" "$name" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
p = json.load(open(sys.argv[1].replace("summary.json", "prediction.json")))
print(f"{sys.argv[2]}: step {s['median_step_seconds'] * 1e3:.0f} ms (predicted {p['step_s'] * 1e3:.0f}), "
      f"exposed communication {s['exposed_comm_per_rank'][0] * 1e3:.0f} ms")
PY
}
for block in ${PW_BLOCKS:-256 64}; do
  for i in $(seq 1 "${PW_ROUNDS:-3}"); do
    run "block$block-on-$i" "$block"
    run "block$block-off-$i" "$block" --no-overlap
  done
done
python3 - "$out" ${PW_BLOCKS:-256 64} <<'PY'
import glob, json, statistics, sys
out = sys.argv[1]
print("| block | overlap step ms | --no-overlap step ms | step ratio | overlap exposed ms | --no-overlap exposed ms | exposed ratio | predicted overlap / --no-overlap ms |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for block in sys.argv[2:]:
    def med(mode, key):
        vals = []
        for f in glob.glob(f"{out}/block{block}-{mode}-*/summary.json"):
            s = json.load(open(f))
            if key == "predicted":
                s = json.load(open(f.replace("summary.json", "prediction.json")))
                vals.append(s["step_s"])
            else:
                vals.append(s["median_step_seconds"] if key == "step" else s["exposed_comm_per_rank"][0])
        return statistics.median(vals) * 1e3
    on, off = med("on", "step"), med("off", "step")
    eon, eoff = med("on", "exposed"), med("off", "exposed")
    pon, poff = med("on", "predicted"), med("off", "predicted")
    print(f"| {block} | {on:.0f} | {off:.0f} | {on / off:.2f} | {eon:.0f} | {eoff:.0f} | {eon / eoff:.2f} | {pon:.0f} / {poff:.0f} |")
PY
