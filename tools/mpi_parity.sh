#!/usr/bin/env bash
# A GPT run under mpirun -np NP must write the same losses and metrics as the same run on local
# threads, and so must the run started with `--distributed` (train relaunching itself as NP
# processes under mpirun); its losses are those of the separate serial trainer within 1e-5
# (examples/serial_oracle.rs, not the engine at one rank). Usage: tools/mpi_parity.sh NP LAYOUT-FLAGS... (for example `2 --pp 2`
# or `2 --tp 2`); PARITY_MODEL="--model llama --n-experts 4" trains that model instead (no
# dropout then). Prints a pass/fail line.
set -euo pipefail
cd "$(dirname "$0")/.."
np=$1
shift
cargo build -q --release -p pipewright-cli --features mpi
bin=target/pipewright-mpi
cp target/release/pipewright "$bin"
cargo build -q --release -p pipewright-models --example serial_oracle
out=target/mpi-parity/$(echo "$*" | tr -c 'a-z0-9' '_')
rm -rf "$out"
read -r -a model <<<"${PARITY_MODEL:---dropout 0.1}"
# Each default that the model's or the layout's flags give again is left to them (a flag given
# twice takes its last value with a note).
defaults=(--n-layer 2 --n-head 2 --n-embd 32 --batch-size 16 --chunk-size 4 --steps 6 --eval-every 3 --schedule 1f1b)
given=" ${model[*]} $* "
common=(train)
for ((i = 0; i < ${#defaults[@]}; i += 2)); do
  [[ "$given" == *" ${defaults[$i]} "* ]] || common+=("${defaults[$i]}" "${defaults[$((i + 1))]}")
done
common+=("${model[@]}")
args=("${common[@]}" "$@")
"$bin" "${args[@]}" --out "$out/local" >/dev/null
bash tools/mpirun.sh "$np" "$bin" "${args[@]}" --backend mpi --out "$out/mpi" >/dev/null
"$bin" "${args[@]}" --distributed --out "$out/relaunched" >/dev/null
rows=$(($(wc -l <"$out/mpi/scalars.csv") - 1))
for run in mpi relaunched; do
  if ! diff <(cut -d, -f2,4 "$out/local/scalars.csv") <(cut -d, -f2,4 "$out/$run/scalars.csv"); then
    echo "mpi parity ($*): $run (-np $np) and local threads write different losses"
    echo "0 passed, 1 failed"
    exit 1
  fi
done
# Against the separate serial trainer on the run the mpi run's directory records (other
# summation orders): every logged loss within relative 1e-5, and every step's loss there.
worst=$(target/release/examples/serial_oracle "$out/mpi" |
  awk -F, 'NR == FNR { want[FNR] = $1; n = FNR; next }
    FNR > 1 { d = (want[$1] - $2) / want[$1]; if (d < 0) d = -d; if (d > w) w = d; k++ }
    END { if (k == 0 || n == 0) w = 1; printf "%.2e", w }' - "$out/mpi/scalars.csv")
if awk -v w="$worst" 'BEGIN { exit !(w < 1e-5) }'; then
  echo "mpi parity ($*): ${PARITY_MODEL:-GPT} under mpirun -np $np and with --distributed write the local run's losses and metrics, and the serial trainer's losses within $worst ($rows rows)"
  echo "1 passed, 0 failed"
else
  echo "mpi parity ($*): losses differ from the serial trainer's by $worst"
  echo "0 passed, 1 failed"
  exit 1
fi
