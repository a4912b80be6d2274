#!/usr/bin/env bash
# Makes crates/pipewright-cli/tests/fixtures/run_parity/ (issue 61), which tests/run_parity.rs
# trains against: token shards (from this repository's CUDA kernel sources, vocabulary 320), a
# tiny Hugging Face Llama and GPT-2 (transformers' own initialisation, saved with
# save_pretrained), the windows of 12 steps of 8 rows of 32 tokens (`pipewright data windows`,
# seed 0), and each model's per-step losses and final held-out loss trained by PyTorch on those
# windows (tools/run_parity.py: AdamW lr 3e-3, betas 0.9/0.95, warm-up 3 then cosine to 0.1,
# clip 1.0, weight decay 0.1 on matrices and embeddings, and again on matrices alone). Needs
# the PyTorch venv (../shared/tools/torch-env.sh, then `pip install transformers`) as $PYTHON,
# and target/release/pipewright. Not for CI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$HOME/.cache/pipewright-torch-env/bin/python}
P=target/release/pipewright
out=crates/pipewright-cli/tests/fixtures/run_parity
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
rm -rf "$out" && mkdir -p "$out"
$P data tokenizer --vocab-size 320 --out "$tmp/tok.json" crates/pipewright/src/kernels/cuda
$P data prepare --tokenizer "$tmp/tok.json" --out "$out/shards" crates/pipewright/src/kernels/cuda
"$PY" - "$out" <<'PY'
import sys, torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
out = sys.argv[1]
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=32, tie_word_embeddings=False)).save_pretrained(f"{out}/llama")
GPT2LMHeadModel(GPT2Config(vocab_size=320, n_positions=32, n_embd=32, n_layer=2, n_head=4,
    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
    eos_token_id=None)).save_pretrained(f"{out}/gpt2")
PY
rm -f "$out"/*/generation_config.json
$P data windows --data "$out/shards" --block-size 32 --batch-size 8 --steps 12 --seed 0 \
  --out "$out/windows.csv"
for m in llama gpt2; do
  "$PY" tools/run_parity.py "$out/$m" "$out/shards" "$out/windows.csv" "$out/torch-$m.csv" \
    --block-size 32 --lr 3e-3 --warmup 3 --beta2 0.95 --weight-decay 0.1 --clip 1.0
  "$PY" tools/run_parity.py "$out/$m" "$out/shards" "$out/windows.csv" \
    "$out/torch-$m-matrices.csv" --block-size 32 --lr 3e-3 --warmup 3 --beta2 0.95 \
    --weight-decay 0.1 --clip 1.0 --decay matrices
done
du -sh "$out"
