"""Tokens/s of encoding a corpus into u16 token shards with Hugging Face's Python `tokenizers`
package (its Rust core, batch-encoded in parallel: `encode_batch`, and `encode_batch_fast`, which
computes no offsets), beside `pipewright data prepare` on the same files with the same
tokenizer.json: the BENCHMARKS.md table.

    /tmp/tok/bin/python tools/bench_prepare.py TOKENIZER.json CORPUS_DIR
"""
import array
import glob
import os
import subprocess
import sys
import tempfile
import time

from tokenizers import Tokenizer

tok_path, corpus = sys.argv[1], sys.argv[2]
files = sorted(glob.glob(os.path.join(corpus, "*")))
tok = Tokenizer.from_file(tok_path)
eos = tok.token_to_id("<|endoftext|>")



def python(encode):
    """Seconds and ids of encoding the corpus 32 files at a time with `encode`."""
    start = time.perf_counter()
    out = array.array("H")
    batch = []
    for f in files + [None]:
        if f is not None:
            with open(f, encoding="utf-8") as fh:
                batch.append(fh.read())
        if len(batch) == 32 or (f is None and batch):
            for e in encode(batch, add_special_tokens=False):
                out.extend(e.ids)
                out.append(eos)
            batch = []
    with tempfile.NamedTemporaryFile(suffix=".bin") as t:
        out.tofile(t)
    return time.perf_counter() - start, len(out)


py, n = python(tok.encode_batch)
fast, _ = python(tok.encode_batch_fast)

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with tempfile.TemporaryDirectory() as d:
    start = time.perf_counter()
    subprocess.run([os.path.join(root, "target/release/pipewright"), "data", "prepare",
                    "--tokenizer", tok_path, "--out", os.path.join(d, "shards"), *files],
                   check=True, stdout=subprocess.DEVNULL)
    rs = time.perf_counter() - start
mb = sum(os.path.getsize(f) for f in files) / 1e6
print(f"corpus {mb:.1f} MB, {len(files)} files, {n} tokens")
print(f"python tokenizers encode_batch: {py:.2f} s, {n / py:.0f} tokens/s")
print(f"python tokenizers encode_batch_fast: {fast:.2f} s, {n / fast:.0f} tokens/s")
print(f"pipewright data prepare: {rs:.2f} s, {n / rs:.0f} tokens/s (ratio {py / rs:.2f}, "
      f"{fast / rs:.2f} to encode_batch_fast)")
