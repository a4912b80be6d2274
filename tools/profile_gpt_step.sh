#!/usr/bin/env bash
# Where a GPT training step's time goes: runs the benchmark of benches/gpt_step.rs under
# `perf record`, sampling only the timed steps (the bench enables perf through a control FIFO
# after its warm-up), and prints each category's share of the samples: matrix products, each
# fused kernel, the optimizer, allocation and page zeroing, copies, candle's other element-wise
# ops, libm, the thread pool and the rest. Needs `perf` (linux-perf) and
# kernel.perf_event_paranoid <= 2. Not used by CI. PW_BENCH_STEPS sets the steps (default 5).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo bench -q -p pipewright-models --bench gpt_step --no-run 2>/dev/null
bin=$(ls -t target/release/deps/gpt_step-* | grep -v '\.d$' | head -1)
dir=$(mktemp -d)
mkfifo "$dir/ctl"
PW_PERF_CTL="$dir/ctl" perf record -q -F 499 -D -1 --control "fifo:$dir/ctl" -o "$dir/perf.data" \
  "$bin" | grep median
perf report -i "$dir/perf.data" --no-children --sort symbol -g none --percent-limit 0 --stdio \
  2>/dev/null | python3 tools/perf_categories.py
rm -rf "$dir"
