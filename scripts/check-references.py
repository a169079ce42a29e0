#!/usr/bin/env python3
"""Every file path and *.md named in the repository's docs and code comments
must exist in the repository (relative to the root, or to the naming file's
folder for Markdown links). Run by `make lint`; prints each broken reference
as file:line: reference."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Folders a path may start with; anything else (URLs, generated output such
# as results/ and target/, paths on the user's machine) is not checked.
TOP = ("crates", "filters", "docs", "policies", "scenarios", "envoy-config",
       "scripts", "tests", "fuzz", "docker")
# Made at run time, not kept in the repository.
GENERATED = ("envoy-config/live",)
SCANNED = (".md", ".rs", ".toml", ".yaml", ".yml", ".sh", ".py")
# A path-like token: letters, digits and ._-/ with at least one / or a .md end.
TOKEN = re.compile(r"(?<![\w./:\[-])((?:\.\./|\./)?[\w.-]+(?:/[\w.*-]+)*/?(?:\.md)?)")


def candidates(line):
    for m in TOKEN.finditer(line):
        ref = m.group(1).rstrip(".")
        if ref.startswith("./"):
            ref = ref[2:]
        first = ref.split("/", 1)[0]
        if ref.endswith(".md") or (first in TOP and "/" in ref):
            if "*" in ref or ref.startswith(GENERATED) or ref.rsplit("/", 1)[-1].startswith("."):
                continue
            yield ref


def exists(ref, source):
    ref = ref.rstrip("/")
    return (ROOT / ref).exists() or (source.parent / ref).exists()


def main():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    broken = []
    for name in files:
        path = ROOT / name
        if path.suffix not in SCANNED or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            line = re.sub(r"\S+://\S+", "", line)
            for ref in candidates(line):
                if not exists(ref, path):
                    broken.append(f"{name}:{number}: {ref}")
    for b in broken:
        print(b)
    if broken:
        print(f"{len(broken)} reference(s) to files that are not in the repository", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
