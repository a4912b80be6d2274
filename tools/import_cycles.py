#!/usr/bin/env python3
"""Finds import cycles between the files of each crate, and files over 500 lines.

Usage: python3 tools/import_cycles.py [CRATE_SRC_DIR ...]   (default: crates/*/src)

A file depends on another when it names an item of it through a `crate::`, `super::` or
`self::` path (in a `use` line or inline in code). A path to a module that only re-exports an
item (`pub use child::Item`) is followed to the file that defines it, so `use crate::model::Cx`
depends on `model/cx.rs`, not on `model/mod.rs`. `mod child;` declarations are not
dependencies: a parent holds its children, it does not use them. Test modules
(`#[cfg(test)] mod tests { ... }`) count as part of their file.

The same check runs between a crate's top-level modules (a folder and its files are one
module), so that dependencies between, say, `shard/` and `model/` go one way.

Exit status 1 and each cycle printed (the files in order) when any crate has one; 0 otherwise.
"""

import os
import re
import sys
from collections import defaultdict

MAX_LINES = 500
ITEM = re.compile(
    r"\b(?:fn|struct|enum|trait|type|const|static|union|macro_rules!)\s+([A-Za-z_][A-Za-z0-9_]*)"
)
MOD_DECL = re.compile(r"\bmod\s+([A-Za-z_][A-Za-z0-9_]*)\s*;")
PATH = re.compile(r"\b(crate|super|self)((?:\s*::\s*[A-Za-z_][A-Za-z0-9_]*)*)(?=\s*::\s*\{|[^:]|$)")


def strip(src):
    """Source with comments, strings and char literals blanked (newlines kept)."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == "r" and re.match(r'r#*"', src[i:]) and (i == 0 or not src[i - 1].isalnum()):
            m = re.match(r'r(#*)"', src[i:])
            end = src.find('"' + m.group(1), i + len(m.group(0)))
            j = n if end < 0 else end + 1 + len(m.group(1))
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append(re.sub(r"[^\n]", " ", src[i : j + 1]))
            i = j + 1
        elif c == "'" and re.match(r"'(\\.|[^\\'])'", src[i : i + 4]) or src.startswith("'\\u{", i):
            j = src.find("'", i + 1)
            out.append(" " * (j + 1 - i))
            i = j + 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


class Crate:
    def __init__(self, src_dir):
        self.src = src_dir
        self.files = {}  # module path tuple -> file path (file-level modules only)
        self.owner = {}  # module path tuple -> file path (inline modules too)
        self.text = {}
        self.items = defaultdict(set)  # module path -> names defined there
        self.reexports = defaultdict(dict)  # module path -> name -> absolute path
        self.globs = defaultdict(list)  # module path -> glob re-export targets
        for root, _, names in os.walk(src_dir):
            for name in names:
                if name.endswith(".rs"):
                    self._add(os.path.join(root, name))
        for mod, path in list(self.files.items()):
            self._index(mod, path)

    def _add(self, path):
        rel = os.path.relpath(path, self.src)[:-3].split(os.sep)
        if rel in (["lib"], ["main"]):
            mod = ()
        elif rel[-1] == "mod":
            mod = tuple(rel[:-1])
        else:
            mod = tuple(rel)
        self.files[mod] = path

    def _scopes(self, text, mod):
        """Yields (module path, start, end) for the file's own module and its inline modules."""
        yield mod, 0, len(text)
        for m in re.finditer(r"\bmod\s+([A-Za-z_][A-Za-z0-9_]*)\s*\{", text):
            depth, j = 1, m.end()
            while j < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                j += 1
            inner = mod + (m.group(1),)
            yield inner, m.end(), j

    def _innermost(self, scopes, pos):
        best = None
        for mod, start, end in scopes:
            if start <= pos < end and (best is None or end - start < best[2] - best[1]):
                best = (mod, start, end)
        return best[0]

    def _index(self, mod, path):
        text = strip(open(path, encoding="utf-8").read())
        self.text[path] = text
        scopes = list(self._scopes(text, mod))
        for inner, _, _ in scopes:
            self.owner[inner] = path
        for m in ITEM.finditer(text):
            self.items[self._innermost(scopes, m.start())].add(m.group(1))
        for m in MOD_DECL.finditer(text):
            self.items[self._innermost(scopes, m.start())].add(m.group(1))
        for m in re.finditer(r"\bpub(?:\s*\([^)]*\))?\s+use\s+([^;]+);", text):
            scope = self._innermost(scopes, m.start())
            for full, alias in expand_use(m.group(1)):
                absolute = self._absolute(scope, full)
                if absolute is None:
                    continue
                if absolute[-1] == "*":
                    self.globs[scope].append(absolute[:-1])
                else:
                    self.reexports[scope][alias] = absolute

    def _absolute(self, scope, segments):
        head, rest = segments[0], list(segments[1:])
        if head == "crate":
            base = []
        elif head in ("self", "super"):
            base = list(scope)
            while head == "super":
                base = base[:-1]
                head = rest.pop(0) if rest and rest[0] == "super" else None
            if head == "super":
                base = base[:-1]
        else:
            # A bare path inside `pub use child::Item` names a child module.
            if (scope + (head,)) in self.owner:
                base, rest = list(scope), list(segments)
            else:
                return None
        return tuple(base + rest)

    def resolve(self, path, seen=None):
        """The file that defines what an absolute path names."""
        seen = seen or set()
        if path in seen:
            return None
        seen.add(path)
        if path in self.owner:
            return self.owner[path]
        # The longest prefix that is a module, then the item inside it.
        for cut in range(len(path) - 1, -1, -1):
            mod = path[:cut]
            if mod not in self.owner:
                continue
            name = path[cut]
            if name in self.reexports[mod]:
                target = self.reexports[mod][name] + path[cut + 1 :]
                found = self.resolve(target, seen)
                if found:
                    return found
            if name in self.items[mod]:
                return self.owner[mod]
            for glob in self.globs[mod]:
                found = self.resolve(glob + path[cut:], seen)
                if found:
                    return found
            return self.owner[mod]
        return None

    def edges(self):
        graph = defaultdict(set)
        for mod, path in self.files.items():
            text = self.text[path]
            scopes = list(self._scopes(text, mod))
            for m in PATH.finditer(text):
                scope = self._innermost(scopes, m.start())
                segs = [m.group(1)] + [s.strip() for s in m.group(2).split("::") if s.strip()]
                # `use a::{b, c}` groups: take each member.
                after = text[m.end() : m.end() + 2000]
                group = re.match(r"\s*::\s*\{", after)
                targets = []
                if group:
                    body = balanced(after[group.end() - 1 :])
                    for full, _ in expand_use("x::{" + body + "}"):
                        targets.append(segs + list(full[1:]))
                else:
                    targets.append(segs)
                for t in targets:
                    if t and t[-1] == "*":
                        t = t[:-1]
                    absolute = self._absolute(scope, t)
                    if absolute is None:
                        continue
                    found = self.resolve(absolute)
                    if found and found != path:
                        graph[path].add(found)
        return graph


def balanced(s):
    """The text inside the brace that opens s."""
    depth = 0
    for i, c in enumerate(s):
        depth += {"{": 1, "}": -1}.get(c, 0)
        if depth == 0:
            return s[1:i]
    return s[1:]


def expand_use(tree):
    """`a::{b, c::d as e}` -> [(('a','b'), 'b'), (('a','c','d'), 'e')]."""
    tree = " ".join(tree.split())
    out = []

    def go(prefix, t):
        t = t.strip()
        if not t:
            return
        brace = t.find("{")
        if brace >= 0 and t.endswith("}"):
            head = [s.strip() for s in t[:brace].split("::") if s.strip()]
            body = t[brace + 1 : -1]
            depth, start = 0, 0
            for i, c in enumerate(body + ","):
                if c == "{":
                    depth += 1
                elif c == "}":
                    depth -= 1
                elif c == "," and depth == 0:
                    go(prefix + head, body[start:i])
                    start = i + 1
            return
        alias = None
        if " as " in t:
            t, alias = [s.strip() for s in t.split(" as ", 1)]
        segs = [s.strip() for s in t.split("::") if s.strip()]
        if segs == ["self"]:
            segs = []
        full = tuple(prefix + segs)
        if full:
            out.append((full, alias or full[-1]))

    go([], tree)
    return out


def cycles(graph):
    """Strongly connected components of more than one file (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def one_cycle(graph, comp):
    """A shortest cycle through the first file of a component, to print."""
    start = comp[0]
    members = set(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def module_graph(src, graph):
    """The same dependencies between the crate's top-level modules (`model/` and `model.rs`
    are one module `model`); the crate root (lib.rs, main.rs) is left out, since it declares
    every module."""

    def top(path):
        first = os.path.relpath(path, src).split(os.sep)[0]
        return first[:-3] if first.endswith(".rs") else first

    out = defaultdict(set)
    for a, targets in graph.items():
        for b in targets:
            ta, tb = top(a), top(b)
            if ta != tb and "lib" not in (ta, tb) and "main" not in (ta, tb):
                out[ta].add(tb)
    return out


def main(args):
    dirs = args or sorted(
        os.path.join("crates", c, "src") for c in os.listdir("crates") if os.path.isdir(os.path.join("crates", c, "src"))
    )
    bad = False
    for d in dirs:
        crate = Crate(d)
        graph = crate.edges()
        for comp in cycles(graph):
            bad = True
            print(f"cycle in {d} ({len(comp)} files): " + " -> ".join(os.path.relpath(p, d) for p in one_cycle(graph, comp)))
        modules = module_graph(d, graph)
        for comp in cycles(modules):
            bad = True
            print(f"cycle between modules of {d}: " + " -> ".join(one_cycle(modules, comp)))
    for d in dirs:
        for root, _, names in os.walk(os.path.dirname(d)):
            for name in names:
                if name.endswith(".rs"):
                    p = os.path.join(root, name)
                    lines = sum(1 for _ in open(p, encoding="utf-8"))
                    if lines > MAX_LINES:
                        bad = True
                        print(f"{p}: {lines} lines (at most {MAX_LINES})")
    if not bad:
        crates = ", ".join(os.path.dirname(d) for d in dirs)
        print(f"no import cycles in {crates}, and no .rs file of theirs over {MAX_LINES} lines")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
