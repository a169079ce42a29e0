#!/usr/bin/env python3
"""The crates' layering, checked on their Cargo.toml dependencies and on
core's imports (run by `make lint`):

- filters (and the test filters) -> glue -> core; only glue and the filters
  depend on proxy-wasm;
- core depends on no other stakegate crate; nothing that runs in Envoy
  depends on the host, the CLI, the stack or the load generator;
- inside core, no policy module (gate, dedup, qos) imports a sibling's module
  for a helper: what they share lives in a neutral module. dedup is part of
  the gate (its pages name the gate's workers), so it may use the gate's
  shard table, and the gate its dedup.
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
SIBLING_OK = {("dedup", "gate"), ("gate", "dedup")}
POLICIES = ("gate", "dedup", "qos")


def dependencies(manifest):
    doc = tomllib.loads(manifest.read_text())
    names = set()
    for table in ("dependencies", "dev-dependencies", "build-dependencies"):
        names |= set(doc.get(table, {}))
    for target in doc.get("target", {}).values():
        for table in ("dependencies", "dev-dependencies"):
            names |= set(target.get(table, {}))
    return doc["package"]["name"], names


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
    core = ROOT / "crates/core/src"
    for policy in POLICIES:
        for path in sorted((core / policy).rglob("*.rs")):
            text = path.read_text()
            for other in POLICIES:
                if other == policy or (policy, other) in SIBLING_OK:
                    continue
                for line, code in enumerate(text.splitlines(), 1):
                    if re.search(rf"\bcrate::{other}::", code) and not code.lstrip().startswith("//"):
                        problems.append(f"{path.relative_to(ROOT)}:{line}: {policy} imports {other}")
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} layering problem(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
