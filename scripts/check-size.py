#!/usr/bin/env python3
"""Sizes a newcomer can read (run by `make lint`): in `crates/core` and
`filters/`, no file over 800 lines and no function over 100 lines.

A file may be longer, or hold a longer function, when its module docs say
why: a line of its `//!` header starting `Long:` (for the file) or naming
the function as `Long fn <name>:` (for a function).

Functions are found by their `fn` line and measured to the line that
closes their body at the same indentation, tests included.
"""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ("crates/core/src", "filters")
MAX_FILE = 800
MAX_FN = 100
FN = re.compile(r"^(\s*)(?:pub(?:\([^)]*\))?\s+)?(?:const\s+)?(?:async\s+)?(?:unsafe\s+)?fn\s+(\w+)")


def header(lines):
    """The `//!` lines at the top of a file."""
    out = []
    for line in lines:
        if line.startswith("//!"):
            out.append(line[3:].strip())
        elif line.strip() and not line.startswith("#!"):
            break
    return out


def functions(lines):
    """(name, first line, length) of each function with a body."""
    for i, line in enumerate(lines):
        m = FN.match(line)
        if not m:
            continue
        indent, name = m.group(1), m.group(2)
        # A declaration without a body (a trait method) ends with `;`.
        j = i
        while j < len(lines) and "{" not in lines[j] and not lines[j].rstrip().endswith(";"):
            j += 1
        if j >= len(lines) or lines[j].rstrip().endswith(";"):
            continue
        if lines[j].rstrip().endswith("}") and lines[j].count("{") == lines[j].count("}"):
            continue  # one line
        close = indent + "}"
        for k in range(j + 1, len(lines)):
            if lines[k].rstrip() == close:
                yield name, i + 1, k - i + 1
                break


def main():
    problems = []
    for tree in TREES:
        for path in sorted((ROOT / tree).rglob("*.rs")):
            if "target" in path.parts:
                continue
            lines = path.read_text().splitlines()
            docs = header(lines)
            rel = path.relative_to(ROOT)
            if len(lines) > MAX_FILE and not any(d.startswith("Long:") for d in docs):
                problems.append(f"{rel}: {len(lines)} lines (at most {MAX_FILE}, or say why in a `//! Long:` line)")
            for name, at, length in functions(lines):
                if length > MAX_FN and not any(d.startswith(f"Long fn {name}:") for d in docs):
                    problems.append(f"{rel}:{at}: fn {name} is {length} lines (at most {MAX_FN}, or say why in a `//! Long fn {name}:` line)")
    for p in problems:
        print(p)
    if problems:
        print(f"{len(problems)} size problem(s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
