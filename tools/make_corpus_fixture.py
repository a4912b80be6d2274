"""The README's JSON-lines corpus: every `## ` section of the project's Markdown files (README.md,
BENCHMARKS.md, docs/*.md) a document, written as gzip-compressed JSON lines with the text in
`text` (and the file and heading beside it), the docs' sections held out in a file of their
own. Run from the repository root:

    python3 tools/make_corpus_fixture.py
"""
import glob
import gzip
import json
import os

OUT = "crates/pipewright-cli/tests/fixtures/corpus"


def sections(path):
    text = open(path, encoding="utf-8").read()
    parts = text.split("\n## ")
    for i, p in enumerate(parts):
        body = p if i == 0 else "## " + p
        yield {"file": path, "heading": body.splitlines()[0], "text": body}


def write(name, paths):
    os.makedirs(OUT, exist_ok=True)
    rows = [s for p in paths for s in sections(p)]
    # mtime 0: the same bytes on every run.
    with open(os.path.join(OUT, name), "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            for r in rows:
                f.write((json.dumps(r) + "\n").encode("utf-8"))
    print(f"{OUT}/{name}: {len(rows)} documents")


write("sections.jsonl.gz", ["README.md", "BENCHMARKS.md"])
write("held-out.jsonl.gz", sorted(glob.glob("docs/*.md")))
