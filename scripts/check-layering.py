#!/usr/bin/env python3
"""The crates' layering, checked on their Cargo.toml dependencies and on
core's imports (run by `make lint`):

- filters (and the test filters) -> glue -> core; only glue and the filters
  depend on proxy-wasm;
- core depends on no other stakegate crate; nothing that runs in Envoy
  depends on the host, the CLI, the stack or the load generator;
- inside core, no policy module (gate, dedup, cache, qos) imports a
  sibling's module for a helper: what they share lives in a neutral module
  (every other top-level module of core), and a neutral module imports no
  policy module. The sibling imports allowed (SIBLING_OK): dedup is part of
  the gate (its pages name the gate's workers), so it may use the gate's
  shard table, and the gate its dedup; the cache is part of the gate too,
  and keeps dedup's answers under dedup's keys, as final as dedup's
  finality says;
- no two files of core import each other, directly or through others: the
  files form layers, each importing only those below it (a module's
  `mod.rs` counts as a file; test code is left out).
"""

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IN_ENVOY = {"stakegate-core", "stakegate-glue", "admission-gate", "stake-qos",
            "ghost-worker", "noop-filter", "host-call-probe"}
# Which stakegate crates each may depend on (all dependency tables).
ALLOWED = {
    "stakegate-core": set(),
    "stakegate-glue": {"stakegate-core"},
    "admission-gate": {"stakegate-core", "stakegate-glue"},
    "stake-qos": {"stakegate-core", "stakegate-glue"},
    "ghost-worker": {"stakegate-core", "stakegate-glue"},
    "noop-filter": set(),
    "host-call-probe": set(),
}
PROXY_WASM_USERS = IN_ENVOY - {"stakegate-core"}
# (importer, imported module): allowed, with the reason above.
SIBLING_OK = {("dedup", "gate"), ("gate", "dedup"), ("gate", "cache"), ("cache", "dedup")}
POLICIES = ("gate", "dedup", "cache", "qos")
CORE = ROOT / "crates/core/src"


def dependencies(manifest):
    doc = tomllib.loads(manifest.read_text())
    names = set()
    for table in ("dependencies", "dev-dependencies", "build-dependencies"):
        names |= set(doc.get(table, {}))
    for target in doc.get("target", {}).values():
        for table in ("dependencies", "dev-dependencies"):
            names |= set(target.get(table, {}))
    return doc["package"]["name"], names


def module_file(parts):
    """The file of core's module `parts`, or None if it is not a module."""
    path = CORE.joinpath(*parts) if parts else CORE / "lib"
    for candidate in (path.with_suffix(".rs"), path / "mod.rs"):
        if candidate.exists():
            return candidate
    return None


def module_of(path):
    parts = list(path.relative_to(CORE).with_suffix("").parts)
    return parts[:-1] if parts[-1] in ("mod", "lib") else parts


def expand(tree):
    """`a::{b, c::{d}}` -> [`a::b`, `a::c::d`]."""
    tree = re.sub(r"\s+", "", tree)
    i = tree.find("{")
    if i < 0:
        return [tree]
    prefix, inner = tree[:i], tree[i + 1 : tree.rfind("}")]
    out, part, depth = [], "", 0
    for ch in inner + ",":
        if ch == "," and depth == 0:
            if part:
                out.extend(prefix + p for p in expand(part))
            part = ""
            continue
        depth += {"{": 1, "}": -1}.get(ch, 0)
        part += ch
    return out


def imports(path):
    """The core files `path` imports (its `use` items and `crate::`/`super::`
    paths), test code left out."""
    text = path.read_text().split("#[cfg(test)]")[0]
    text = "\n".join(l for l in text.splitlines() if not l.lstrip().startswith("//"))
    module = module_of(path)
    paths = []
    for m in re.finditer(r"^\s*(?:pub(?:\([^)]*\))?\s+)?use\s+([^;]+);", text, re.M):
        paths.extend(expand(m.group(1)))
    paths.extend(re.findall(r"(?<![\w:])(\w+(?:::\w+)+)", text))
    found = set()
    for p in paths:
        segs = [s for s in p.split("::") if s]
        if segs[0] == "crate":
            base, segs = [], segs[1:]
        elif segs[0] in ("super", "self"):
            base = list(module)
            while segs and segs[0] == "super":
                base, segs = base[:-1], segs[1:]
            if segs and segs[0] == "self":
                segs = segs[1:]
        elif module_file(module + segs[:1]):
            base = list(module)  # a child module, named from its parent
        else:
            continue
        for k in range(len(segs), -1, -1):
            target = module_file(base + segs[:k])
            if target:
                if target != path:
                    found.add(target)
                break
    return found


def cycles(graph):
    """Each import cycle, once, as the files on it."""
    state, stack, found = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def main():
    workspace = tomllib.loads((ROOT / "Cargo.toml").read_text())["workspace"]
    problems = []
    for member in workspace["members"]:
        name, deps = dependencies(ROOT / member / "Cargo.toml")
        ours = {d for d in deps if d.startswith("stakegate-") or d in ALLOWED}
        if name in ALLOWED:
            for extra in sorted(ours - ALLOWED[name]):
                problems.append(f"{member}: {name} must not depend on {extra}")
        if "proxy-wasm" in deps and name not in PROXY_WASM_USERS:
            problems.append(f"{member}: {name} must not depend on proxy-wasm")
    files = sorted(CORE.rglob("*.rs"))
    graph = {f: imports(f) for f in files}
    for path, targets in graph.items():
        mine = module_of(path)[:1] or ["lib"]
        for target in sorted(targets):
            theirs = module_of(target)[:1] or ["lib"]
            if mine == theirs or theirs[0] not in POLICIES:
                continue
            if mine[0] in POLICIES and (mine[0], theirs[0]) in SIBLING_OK:
                continue
            who = mine[0] if mine[0] in POLICIES else f"the neutral module {mine[0]}"
            problems.append(
                f"{path.relative_to(ROOT)}: {who} imports {target.relative_to(ROOT)} (policy {theirs[0]})"
            )
    for cycle in cycles(graph):
        problems.append("import cycle: " + " -> ".join(str(f.relative_to(CORE)) for f in cycle))
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} layering problem(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
