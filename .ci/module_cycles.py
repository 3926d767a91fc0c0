#!/usr/bin/env python3
"""Report import cycles between sibling modules of each crate in the workspace.

Reads every crate's `src/` as text (nothing is built), builds the module tree from `mod` items,
and records which module each `crate::`, `super::` and `self::` path (and a `use` of a child
module) names, following `pub use` re-exports to where an item is defined. A file and its
submodules count as one module: an edge `a -> b` between two children of one parent says that
something under `a` names something under `b`. Comments (doc links included) and inline
`#[cfg(test)]` modules are left out: they add no dependency to the built crate. A cycle among siblings is printed with the items
that make each of its edges; the exit status is 1 when there is one.

Usage: .ci/module_cycles.py [CRATE_SRC_DIR ...]   (default: every workspace crate's src/)
"""

import os
import re
import sys
from collections import defaultdict

DEFAULT_SRCS = ["src", "schedule/src", "kernels-cubecl/src", "test-support/src", "examples/llama/src"]

MOD_DECL = re.compile(r"^\s*(?:#\[path\s*=\s*\"([^\"]+)\"\]\s*)?(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;", re.M)
PATH_ATTR = re.compile(r"#\[path\s*=\s*\"([^\"]+)\"\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+(\w+)\s*;")
USE_STMT = re.compile(r"\b(pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", re.S)
INLINE_PATH = re.compile(r"\b((?:crate|super|self)(?:::\w+)+)")
LINE_COMMENT = re.compile(r"//[^\n]*")
TEST_MOD = re.compile(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*mod\s+\w+\s*\{")


def strip_test_modules(text):
    """The text without its inline `#[cfg(test)] mod name { ... }` blocks (test-only imports)."""
    while True:
        m = TEST_MOD.search(text)
        if not m:
            return text
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        text = text[: m.start()] + text[i:]


class Module:
    def __init__(self, path, file):
        self.path = path  # tuple of names from the crate root
        self.file = file
        self.children = {}
        self.reexports = {}  # name -> absolute path (tuple) of what a `use` in this module names
        self.refs = []  # (absolute path tuple, text) the file names


def expand_use(tree):
    """`a::{b, c::{d, e}}` -> [['a', 'b'], ['a', 'c', 'd'], ['a', 'c', 'e']] (`as` kept in the last name)."""
    tree = re.sub(r"\s+", "", tree)
    out = []

    def walk(prefix, s):
        depth, parts, cur = 0, [], ""
        for ch in s:
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
            else:
                cur += ch
        if cur:
            parts.append(cur)
        for part in parts:
            if "{" in part:
                head, rest = part.split("{", 1)
                head_segs = [x for x in head.split("::") if x]
                walk(prefix + head_segs, rest[: rest.rfind("}")])
            else:
                segs = [x for x in part.split("::") if x]
                if segs:
                    out.append(prefix + segs)

    walk([], tree)
    return out


def parse_use(raw):
    """Expand a use tree, keeping `as` aliases (whitespace matters for them)."""
    items = []
    for segs in expand_use(re.sub(r"\s+as\s+", "@AS@", raw)):
        last = segs[-1]
        alias = None
        if "@AS@" in last:
            last, alias = last.split("@AS@")
            segs = segs[:-1] + [last]
        if last == "self":
            segs = segs[:-1]
            name = alias or (segs[-1] if segs else None)
        else:
            name = alias or last
        items.append((segs, name))
    return items


def load_crate(src):
    root_file = os.path.join(src, "lib.rs")
    if not os.path.exists(root_file):
        root_file = os.path.join(src, "main.rs")
    modules = {}

    def load(path, file):
        mod = Module(path, file)
        modules[path] = mod
        text = LINE_COMMENT.sub("", open(file, encoding="utf-8").read())
        mod.text = strip_test_modules(text)
        here = os.path.dirname(file)
        is_dir_owner = os.path.basename(file) in ("mod.rs", "lib.rs", "main.rs")
        child_dir = here if is_dir_owner else os.path.join(here, os.path.splitext(os.path.basename(file))[0])
        explicit = {m.group(2): m.group(1) for m in PATH_ATTR.finditer(text)}
        for m in MOD_DECL.finditer(text):
            name = m.group(2)
            if name in explicit:
                child = os.path.join(here, explicit[name])
            else:
                child = os.path.join(child_dir, name + ".rs")
                if not os.path.exists(child):
                    child = os.path.join(child_dir, name, "mod.rs")
            if os.path.exists(child):
                mod.children[name] = load(path + (name,), child)
        return mod

    load((), root_file)
    return modules


def absolute(mod, segs, modules, in_inline_mod):
    """Absolute path of `segs` as written in `mod` (None for external crates and std)."""
    base = list(mod.path)
    if in_inline_mod and segs and segs[0] == "super":
        segs = ["self"] + segs[1:]
    if not segs:
        return None
    if segs[0] == "crate":
        return tuple(segs[1:])
    if segs[0] in ("self", "super"):
        while segs and segs[0] in ("self", "super"):
            if segs[0] == "super":
                base = base[:-1]
            segs = segs[1:]
        return tuple(base + segs)
    if segs[0] in mod.children:  # 2018 edition: a child module named without `self::`
        return tuple(base + segs)
    return None


def resolve(path, modules, depth=0):
    """The module that defines what `path` names (following re-exports)."""
    cur = ()
    for i, seg in enumerate(path):
        mod = modules[cur]
        if seg in mod.children:
            cur = cur + (seg,)
            continue
        if seg in mod.reexports and depth < 20:
            target = mod.reexports[seg]
            return resolve(tuple(target) + tuple(path[i + 1 :]), modules, depth + 1)
        return cur
    return cur


def analyse(src):
    modules = load_crate(src)
    # Pass 1: what each module's `use` items name (so re-exports can be followed).
    for mod in modules.values():
        text = mod.text
        inline = re.search(r"^\s*mod\s+\w+\s*\{", text, re.M)
        for m in USE_STMT.finditer(text):
            in_inline = bool(inline and m.start() > inline.start())
            for segs, name in parse_use(m.group(2)):
                target = absolute(mod, segs, modules, in_inline)
                if target is None:
                    continue
                mod.refs.append((target, "::".join(segs)))
                if not in_inline and name and name != "*":
                    mod.reexports.setdefault(name, target)
        for m in INLINE_PATH.finditer(USE_STMT.sub("", text)):
            in_inline = bool(inline and m.start() > inline.start())
            segs = m.group(1).split("::")
            target = absolute(mod, segs, modules, in_inline)
            if target is not None:
                mod.refs.append((target, m.group(1)))
    # Pass 2: edges between siblings.
    edges = defaultdict(lambda: defaultdict(set))  # parent -> (a, b) -> {items}
    for mod in modules.values():
        for target, text in mod.refs:
            if target and target[-1] == "*":
                target = target[:-1]
            defined = resolve(target, modules)
            a, b = mod.path, defined
            n = 0
            while n < len(a) and n < len(b) and a[n] == b[n]:
                n += 1
            if n < len(a) and n < len(b):
                item = "::".join(target) or "crate"
                edges[a[:n]][(a[n], b[n])].add(f"{'/'.join(mod.path) or 'root'}: {item}")
    return modules, edges


def cycles(pairs):
    graph = defaultdict(set)
    for a, b in pairs:
        graph[a].add(b)
    # Tarjan's strongly connected components.
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
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

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def main():
    srcs = sys.argv[1:] or DEFAULT_SRCS
    found = False
    for src in srcs:
        if not os.path.isdir(src):
            continue
        _, edges = analyse(src)
        for parent, pairs in sorted(edges.items()):
            for comp in cycles(pairs):
                found = True
                where = "::".join(("crate",) + parent)
                print(f"{src}: cycle under {where}: {' <-> '.join(comp)}")
                for (a, b), items in sorted(pairs.items()):
                    if a in comp and b in comp:
                        print(f"  {a} -> {b}:")
                        for item in sorted(items):
                            print(f"    {item}")
    if not found:
        print("no cycles between sibling modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
