#!/usr/bin/env bash
# Issue 17's checks on a GPU machine (device time is scarce; a device command runs 10 minutes
# at most): run from the repository root with gpu/ carried (tools/pack-gpu.sh made it), as
# `bash tools/gpu-checks.sh [kernels] [correctness] [speed] [models] [profile] [pipeline] [planner] [features]`
# (all but profile by default; one call each fits the limit). Each check logs to gpu/out/NAME.log and a line per check says ok or FAILED; a
# failure does not stop the rest, and the script then ends non-zero naming every failed check. The logs go back as one archive, $OUT/gpu-logs.tgz (the
# device returns at most 8 files).
# kernels (issue 57):
#  - every CUDA kernel (GELU, bias add, LayerNorm, cross-entropy (also over rows read in place
#    from wider ones), causal attention (bf16 and f16 through the tensor-core flash kernels,
#    then every type through cuBLAS and the SIMT flash kernels), the sum of squares, dropout, the Llama's RMSNorm,
#    SwiGLU and rotary positions) against its CPU twin, forward and backward, f32, bf16 and f16, odd and empty
#    sizes (the library's tests `kernels::gpu_tests`); the optimizer phase's one-launch kernels
#    (AdamW, the casts, the sums of squares over many tensors) against the CPU's per-tensor
#    ops, bit for bit (`kernels::gpu_tests_step`); a batch's host copies (`batch::gpu_tests`):
#    the library's tests named `gpu_tests`
#  - the HF GPT-2, Llama and MoE fixture parities on the GPU, which now run those kernels
# correctness:
#  - the HF GPT-2, Llama, Mixtral and Qwen3-MoE fixture parities on the GPU (logits and loss
#    1e-5, gradients 1e-4 relative, as on the CPU; the MoE ones at every expert-parallel layout)
#  - the NCCL communicator's conformance suite on one rank, with CPU tensors and GPU tensors
#  - the README main job with --device cuda (2 pipeline stages x 2 tensor-parallel shards as
#    threads sharing the GPU), which must reach the README's held-out accuracy; then a short
#    run with --backend nccl (one rank: one GPU cannot hold two NCCL ranks)
# speed (PW_GPU_PRECISIONS picks the precisions, default "f32 bf16"):
#  - the GPT-2 124M step (vocabulary 50257, d 768, 12 layers, sequence 1024, batch
#    $PW_BENCH_BATCH, default 8), f32 and bf16, pipewright and PyTorch eager side by side,
#    with peak GPU memory and MFU against the H100 SXM's dense peaks (989 TFLOP/s bf16, 67 f32);
#    and the 1.3B shape (24 layers, d 2048, 16 heads) in bf16, pipewright and PyTorch eager
#  - the bf16 step again with a vocabulary of 50304 (its head aligned without padding), and
#    with PIPEWRIGHT_GPU_ATTENTION=cublas (attention through cuBLAS, not the tensor-core flash
#    kernels)
#  - one bf16 step of pipewright's under Nsight Compute, its kernel time summed by kind
#    (tools/gpu_kernels.py) against the step's wall time
# models (issue 77's new rows): a Llama 1B-class shape (16 layers, d 2048, 32 heads, 8 key/value
# heads, SwiGLU 8192, vocabulary 128256, batch 4 of 2048 tokens) and a small Mixtral (8 layers,
# d 1024, 8 experts of 3584, top 2, batch 8 of 1024) in bf16, pipewright and PyTorch eager
# (transformers' LlamaForCausalLM and MixtralForCausalLM) side by side
# profile (after speed, whose 1.3B step time it reads):
#  - one bf16 step of the 1.3B shape under Nsight Compute, its kernel time by kind
# pipeline:
#  - GPT-2 124M trained by `pipewright train` in bf16 (the text task on README.md's bytes, the
#    vocabulary padded to 50257, batch 8 of 1024 tokens in 4 micro-batches, 20 steps): one
#    stage, two stages as threads of one process, and two stages as two processes under
#    Open MPI (tools/mpirun.sh with the packed runtime, gpu/mpi.txz; activations cross
#    through the host), all on the one GPU; a table of median step time and tokens/s
# planner (issue 35: the device's curve measured, and the planner against PyTorch on it):
#  - `pipewright profile --gemm` in bf16 and in f32 (--gemm-scale 8) on the GPU, into one
#    hardware file on top of h100-node (gpu/out/hw-measured.json)
#  - the same products, the streaming bandwidth and fused (flash) attention timed in PyTorch
#    (tools/gemm_torch.py --write, which writes the attention rates and the bandwidth into
#    the file)
#  - the GPT-2 124M bf16 step in PyTorch, eager at batch 8 and compiled (flash attention,
#    torch.compile, fused AdamW: what the planner's roofline models) at batch 8 and 32, and
#    GPT-2 350M and a 1.3B GPT (GPT-3 XL's widths) compiled at batch 8; each with one step's
#    kernel time by kind; then `plan`'s predictions for the compiled runs on the measured file
#    beside them (tools/planner_vs_torch.py: docs/planner.md's "One GPU" table)
# features (what came after the first GPU runs, each trained on the GPU and on the CPU by the
# same binary, 30 steps; every step's loss within relative 1e-5 in f32 (the CPU build's
# tolerance) and 1e-3 in bf16, and the GPU's allocated peak (its memory pool's high-water
# mark) at most 1.5 times the CPU run's counted one):
#  - a Llama (grouped-query attention) over 2 pipeline stages x 2 tensor-parallel shards
#  - ZeRO-3 over 2 replicas; ZeRO-1 over 2 replicas of a Llama in bf16
#  - context parallelism (cp 2) with tensor and sequence parallelism (tp 2)
#  - a BPE tokenizer and token shards made here (`pipewright data`), a Llama trained on them
set -uo pipefail
cd "$(dirname "$0")/.."
out=gpu/out
mkdir -p "$out"
for f in gpu/*.xz; do [ -x "${f%.xz}" ] || { xz -dkf "$f" && chmod +x "${f%.xz}"; }; done
[ -d gpu/mpi ] || [ ! -f gpu/mpi.txz ] || { mkdir gpu/mpi && tar -C gpu/mpi -xJf gpu/mpi.txz; }
run() { bash tools/run-on-gpu.sh "$@"; }
failed=()
passed=0
verdict() { # NAME OK WHY: counts the check and says ok or FAILED with why
  if [ "$2" -eq 0 ]; then
    echo "$1: ok${3:+ ($3)}"; passed=$((passed + 1))
  else
    echo "$1: FAILED${3:+ ($3)}"; failed+=("$1")
  fi
}
ran=" "
check() { # NAME COMMAND...: runs it, logs to $out/NAME.log, says ok or FAILED (once a call)
  local name=$1 code; shift
  case $ran in *" $name "*) return 0 ;; esac
  ran="$ran$name "
  "$@" > "$out/$name.log" 2>&1
  code=$?
  verdict "$name" "$code" "$([ "$code" -ne 0 ] && echo "exit $code")"
  tail -n 4 "$out/$name.log"
}
kernels() {
  check gpu-kernels run gpu/lib_tests gpu_tests --test-threads 1 --nocapture
  grep -E "off by|panicked" "$out/gpu-kernels.log" | head -20
  hf_parities
}
hf_parities() { # the HF GPT-2, Llama and MoE (Mixtral, Qwen3-MoE) parities on the GPU
  for t in gpt_parity llama_parity hf_moe; do
    check "$t" env PW_TEST_DEVICE=cuda CARGO_MANIFEST_DIR="$PWD/crates/pipewright-models" \
      bash tools/run-on-gpu.sh "gpu/$t" --test-threads 1
  done
}
correctness() {
  hf_parities
  check nccl env PW_TEST_DEVICE=cuda bash tools/run-on-gpu.sh gpu/nccl_probe --nocapture
  rm -rf runs/adder-gpu runs/adder-nccl
  check adder run gpu/pipewright train --model gpt --task adder --pp 2 --tp 2 --chunks 4 \
    --steps 1000 --device cuda --out runs/adder-gpu
  check nccl-train run gpu/pipewright train --model gpt --task adder --backend nccl \
    --steps 200 --device cuda --out runs/adder-nccl
}
speed() {
  export PW_BENCH_SIZE=gpt2 PW_BENCH_DEVICE=cuda PW_BENCH_BATCH=${PW_BENCH_BATCH:-8}
  for p in ${PW_GPU_PRECISIONS:-f32 bf16}; do
    peak=$([ $p = bf16 ] && echo 989 || echo 67)
    check "bench-pipewright-$p" env PW_BENCH_PRECISION=$p PW_BENCH_PEAK_TFLOPS=$peak \
      bash tools/run-on-gpu.sh gpu/gpt_step --bench
    check "bench-torch-$p" env PW_BENCH_PRECISION=$p PW_BENCH_PEAK_TFLOPS=$peak \
      python3 tools/bench_torch.py
  done
  # The 1.3B shape (GPT-3 XL's widths, batch 8 of 1024 tokens) in bf16, side by side.
  check bench-pipewright-1.3b-bf16 env PW_BENCH_SIZE=gpt-1.3b PW_BENCH_PRECISION=bf16 \
    PW_BENCH_PEAK_TFLOPS=989 bash tools/run-on-gpu.sh gpu/gpt_step --bench
  check bench-torch-1.3b-bf16 env PW_BENCH_SIZE=gpt-1.3b PW_BENCH_PRECISION=bf16 \
    PW_BENCH_PEAK_TFLOPS=989 python3 tools/bench_torch.py
  # The same bf16 step with the vocabulary at 50304, a multiple of 64, against GPT-2's odd
  # 50257, whose head the model now multiplies padded (nn::linear): the two should take the
  # same time, and the profile below should show no `cutlass_75` products for the head.
  check bench-pipewright-bf16-vocab50304 env PW_BENCH_PRECISION=bf16 PW_BENCH_VOCAB=50304 \
    PW_BENCH_STEPS=3 PW_BENCH_PEAK_TFLOPS=989 bash tools/run-on-gpu.sh gpu/gpt_step --bench
  # The bf16 step with attention through cuBLAS and row kernels (the path before the
  # tensor-core flash kernels, kernels/cuda/flash.cu), side by side with the default above.
  check bench-pipewright-bf16-cublas-attention env PW_BENCH_PRECISION=bf16 PW_BENCH_STEPS=3 \
    PIPEWRIGHT_GPU_ATTENTION=cublas PW_BENCH_PEAK_TFLOPS=989 \
    bash tools/run-on-gpu.sh gpu/gpt_step --bench
  local step_ms
  step_ms=$(awk '/pipewright_median_ms/ {print $2}' "$out/bench-pipewright-bf16.log")
  check profile-bf16 env PW_BENCH_PRECISION=bf16 PW_BENCH_STEPS=1 PW_CUDA_PROFILE=1 \
    bash tools/run-on-gpu.sh ncu --profile-from-start off --clock-control none \
    --metrics gpu__time_duration.sum --csv --print-units base --log-file "$out/ncu-bf16.csv" \
    gpu/gpt_step --bench
  python3 tools/gpu_kernels.py "$out/ncu-bf16.csv" ${step_ms:+--step-ms $step_ms} \
    | tee "$out/profile-bf16.txt"
}
models() {
  # The Llama 1B-class shape (grouped-query attention, batch 4 of 2048 tokens) and a small
  # Mixtral (8 experts, top 2, batch 8 of 1024) in bf16, pipewright and PyTorch eager side by side.
  local size batch
  for size in llama-1b moe-small; do
    batch=$([ $size = llama-1b ] && echo 4 || echo 8)
    check "bench-pipewright-$size-bf16" env PW_BENCH_SIZE=$size PW_BENCH_BATCH=$batch \
      PW_BENCH_DEVICE=cuda PW_BENCH_PRECISION=bf16 PW_BENCH_PEAK_TFLOPS=989 \
      bash tools/run-on-gpu.sh gpu/gpt_step --bench
    check "bench-torch-$size-bf16" env PW_BENCH_SIZE=$size PW_BENCH_BATCH=$batch \
      PW_BENCH_DEVICE=cuda PW_BENCH_PRECISION=bf16 PW_BENCH_PEAK_TFLOPS=989 python3 tools/bench_torch.py
  done
}
profile() {
  # The 1.3B shape's bf16 step under Nsight Compute, its kernel time by kind: where the time
  # between its MFU and the issue's 35 % goes (the speed group profiles GPT-2 124M only).
  local step_ms
  step_ms=$(awk '/pipewright_median_ms/ {print $2}' "$out/bench-pipewright-1.3b-bf16.log" 2>/dev/null)
  check profile-1.3b-bf16 env PW_BENCH_SIZE=gpt-1.3b PW_BENCH_PRECISION=bf16 PW_BENCH_STEPS=1 \
    PW_CUDA_PROFILE=1 bash tools/run-on-gpu.sh ncu --profile-from-start off --clock-control none \
    --metrics gpu__time_duration.sum --csv --print-units base --log-file "$out/ncu-1.3b-bf16.csv" \
    gpu/gpt_step --bench
  python3 tools/gpu_kernels.py "$out/ncu-1.3b-bf16.csv" ${step_ms:+--step-ms $step_ms} \
    | tee "$out/profile-1.3b-bf16.txt"
}
pipeline() {
  local gpt2=(--model gpt --task text --data README.md --block-size 1024 --vocab-size 50257
    --n-layer 12 --n-head 12 --n-embd 768 --batch-size 8 --chunks 4 --precision bf16
    --steps 20 --log-every 5 --device cuda)
  rm -rf runs/gpt2-pp1 runs/gpt2-pp2-threads runs/gpt2-pp2-mpi
  check gpt2-pp1 run gpu/pipewright train "${gpt2[@]}" --out runs/gpt2-pp1
  check gpt2-pp2-threads run gpu/pipewright train "${gpt2[@]}" --pp 2 --out runs/gpt2-pp2-threads
  check gpt2-pp2-mpi env PW_MPI_HOME=gpu/mpi bash tools/mpirun.sh 2 bash tools/run-on-gpu.sh \
    gpu/pipewright-mpi train "${gpt2[@]}" --pp 2 --backend mpi --out runs/gpt2-pp2-mpi
  for name in gpt2-pp1 gpt2-pp2-threads gpt2-pp2-mpi; do
    awk -v n=$name '/^step time/ {t = $3} /^throughput/ {s = $2} END {print n ": step " t " ms, " s " tokens/s"}' \
      "$out/$name.log"
  done | tee "$out/pipeline.txt"
}
planner() {
  local hw=$out/hw-measured.json
  check gemm-bf16 run gpu/pipewright profile --gemm --device cuda --precision bf16 \
    --gemm-scale 8 --hardware h100-node --out "$out/hw-bf16.json"
  check gemm-f32 run gpu/pipewright profile --gemm --device cuda --precision f32 \
    --gemm-scale 8 --hardware "$out/hw-bf16.json" --out "$hw"
  check gemm-torch python3 tools/gemm_torch.py "$hw" --write
  export PW_BENCH_SIZE=gpt2 PW_BENCH_DEVICE=cuda PW_BENCH_PRECISION=bf16 PW_BENCH_PEAK_TFLOPS=989
  export PW_BENCH_KERNELS=1
  check torch-eager-b8 env PW_BENCH_BATCH=8 python3 tools/bench_torch.py
  for b in 8 32; do
    check "torch-compiled-b$b" env PW_BENCH_BATCH=$b PW_BENCH_STEPS=10 PW_BENCH_TORCH=compiled \
      python3 tools/bench_torch.py
  done
  for size in gpt2-medium gpt-1.3b; do
    check "torch-compiled-$size-b8" env PW_BENCH_SIZE=$size PW_BENCH_BATCH=8 PW_BENCH_STEPS=10 \
      PW_BENCH_TORCH=compiled python3 tools/bench_torch.py
  done
  check planner-vs-torch python3 tools/planner_vs_torch.py "bash tools/run-on-gpu.sh gpu/pipewright" \
    "$hw" "$out"/torch-compiled-*.log
  cat "$out/planner-vs-torch.log"
}
same_losses() { # NAME TOLERANCE ARGS...: trains ARGS on the GPU and on the CPU, compares the losses
  local name=$1 tol=$2 worst; shift 2
  rm -rf "runs/$name-cuda" "runs/$name-cpu"
  check "$name-cuda" run gpu/pipewright train "$@" --device cuda --out "runs/$name-cuda"
  check "$name-cpu" run gpu/pipewright train "$@" --device cpu --out "runs/$name-cpu"
  worst=$(paste -d, <(cut -d, -f2 "runs/$name-cpu/scalars.csv") <(cut -d, -f2 "runs/$name-cuda/scalars.csv") |
    awk -F, 'NR > 1 { n++; d = ($1 - $2) / $1; if (d < 0) d = -d; if (d > w) w = d } END { if (n < 30) print "missing"; else printf "%.2e", w }')
  [ "$worst" != missing ] && awk -v w="$worst" -v t="$tol" 'BEGIN { exit !(w < t) }'
  verdict "$name" $? "GPU against CPU losses: $worst over 30 steps, tolerance $tol"
  # The GPU's memory pool high-water mark beside the CPU run's counted peak (all ranks): at
  # most 1.5 times it (measured 0.50-1.22 on an H100).
  local peak
  peak=$(python3 - "$name" <<'PY'
import json, sys
name = sys.argv[1]
gpu, cpu = (json.load(open(f"runs/{name}-{d}/summary.json")).get("training_peak_allocated_bytes")
            for d in ("cuda", "cpu"))
if gpu and cpu:
    print(f"{gpu / cpu:.2f} GPU {gpu / 2**20:.1f} MiB, CPU {cpu / 2**20:.1f} MiB")
else:
    print(f"missing GPU {gpu}, CPU {cpu}")
PY
)
  awk -v r="${peak%% *}" 'BEGIN { exit !(r + 0 > 0 && r + 0 <= 1.5) }'
  verdict "$name-peak" $? "ratio ${peak}, at most 1.5"
}
features() {
  local base=(--task adder --steps 30 --chunks 2 --log-every 1 --eval-every 1000)
  # f32: the CPU build's 1e-5 (measured 6.5e-08 to 1.2e-07); bf16: 1e-3 (measured 1.5e-4).
  same_losses llama-pp2-tp2 1e-5 "${base[@]}" --model llama --n-kv-head 2 --pp 2 --tp 2
  same_losses zero3-dp2 1e-5 "${base[@]}" --dp 2 --zero 3
  same_losses llama-zero1-bf16 1e-3 "${base[@]}" --model llama --dp 2 --zero 1 --precision bf16
  same_losses cp2-tp2-sp 1e-5 "${base[@]}" --cp 2 --tp 2 --sequence-parallel --digits 4
  rm -rf runs/tok.json runs/shards
  check tokenizer run gpu/pipewright data tokenizer --vocab-size 1024 --out runs/tok.json crates/pipewright/src
  check shards run gpu/pipewright data prepare --tokenizer runs/tok.json --out runs/shards crates/pipewright/src
  same_losses llama-tokens 1e-5 --model llama --n-head 4 --n-kv-head 2 --task tokens --data runs/shards \
    --block-size 64 --n-embd 64 --batch-size 16 --pp 2 --dp 2 --chunks 2 --steps 30 --eval-every 1000
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
for group in "${@:-kernels correctness speed models pipeline planner features}"; do
  for g in $group; do
    case $g in
      kernels | correctness | speed | models | profile | pipeline | planner | features) $g
        # The logs so far, so a call cut short at its limit still returns them.
        [ -n "${OUT:-}" ] && tar czf "$OUT/gpu-logs.tgz" -C "$out" . ;;
      *) echo "usage: tools/gpu-checks.sh [kernels] [correctness] [speed] [models] [profile] [pipeline] [planner] [features]" >&2; exit 2 ;;
    esac
  done
done
# Any failed comparison ends the script non-zero, naming what failed.
if [ "${#failed[@]}" -gt 0 ]; then
  echo "gpu-checks: ${#failed[@]} failed (${failed[*]}), $passed passed"
  exit 1
fi
echo "gpu-checks: $passed passed, 0 failed"
