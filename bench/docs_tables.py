"""``python -m bench.docs_tables [--write]``: the tables of measured numbers in the docs, each
checked against (or, with ``--write``, rebuilt from) the records it cites.

A page cites its records on the line before a table:

    <!-- records: bench/recorded/FILE.jsonl BENCHMARK [MODE] -->

and the table that follows must be the benchmark's own ``table`` of those records (its
first Markdown table; ``MODE`` for a benchmark with several, as scaling's strong and weak),
so a number in the docs is a number in a committed record, with its range and repeats.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from bench import benchmarks
from bench.core import ROOT, read_records

MARK = re.compile(r"^<!-- records: (\S+) (\w+)(?: (\w+))? -->$")
PAGES = ("README.md", "docs/*.md")


def first_table(text: str) -> list[str]:
    """The lines of the first Markdown table in ``text``."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("|")), None)
    if start is None:
        return []
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return lines[start:end]


def expected(path: str, name: str, mode: str | None) -> list[str]:
    records = read_records(ROOT / path, name)
    if not records:
        raise ValueError(f"{path}: no records of {name}")
    mod = benchmarks.load(name)
    return first_table(mod.table(records, mode) if mode else mod.table(records))


def pages() -> list[Path]:
    return sorted({p for pattern in PAGES for p in ROOT.glob(pattern)})


def problems(write: bool = False, files: list[Path] | None = None) -> list[str]:
    """What differs between each cited table and its records (rewritten with ``write``)."""
    out = []
    for page in pages() if files is None else files:
        lines = page.read_text().splitlines()
        changed = False
        i = 0
        while i < len(lines):
            m = MARK.match(lines[i])
            i += 1
            if not m:
                continue
            where = f"{page.name}:{i}"
            try:
                want = expected(*m.groups())
            except (OSError, ValueError) as e:
                out.append(f"{where}: {e}")
                continue
            start = i + (1 if i < len(lines) and not lines[i].strip() else 0)
            got = first_table("\n".join(lines[start:]))
            if lines[start : start + len(got)] != got or not got:
                got = []
            if got != want:
                out.append(f"{where}: the table differs from {m.group(1)}'s {m.group(2)} records")
                if write:
                    lines[start : start + len(got)] = want if got else [*want, ""]
                    changed = True
        if changed:
            page.write_text("\n".join(lines) + "\n")
    return out


def main(argv: list[str]) -> int:
    write = "--write" in argv
    found = problems(write)
    for line in found:
        print(line, file=sys.stderr)
    return 0 if write or not found else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
