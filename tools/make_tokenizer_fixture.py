"""Makes crates/pipewright/tests/fixtures/tokenizer: a small byte-level BPE trained by Hugging
Face's Python `tokenizers` package (GPT-2's pre-tokenizer, no prefix space, <|endoftext|>) on
this project's pipeline sources, and the ids that package gives for a few texts. The Rust test
checks pipewright's Tokenizer gives the same ids on the same tokenizer.json.

    python3 -m venv /tmp/tok && /tmp/tok/bin/pip install tokenizers
    /tmp/tok/bin/python tools/make_tokenizer_fixture.py
"""
import glob
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
out = os.path.join(root, "crates/pipewright/tests/fixtures/tokenizer")
os.makedirs(out, exist_ok=True)
files = sorted(glob.glob(os.path.join(root, "crates/pipewright/src/parallel/pipeline/*.rs")))

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.post_processor = processors.ByteLevel(trim_offsets=True)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=500,
    min_frequency=0,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    special_tokens=["<|endoftext|>"],
    show_progress=False,
)
tok.train(files, trainer)
tok.save(os.path.join(out, "tokenizer.json"))

texts = [
    "fn main() {\n    println!(\"hello\");\n}\n",
    "pub fn schedule(p: usize, m: usize) -> Result<Schedule>",
    "  leading spaces and\ttabs\n\n",
    "ünïcödé ✓ 日本語",
    "1F3 1B3 0W2",
    "",
]
cases = [[t, tok.encode(t).ids] for t in texts]
with open(os.path.join(out, "ids.json"), "w") as f:
    json.dump(cases, f, ensure_ascii=False, indent=1)
print("wrote", out)
