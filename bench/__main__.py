"""``python -m bench LIST`` | ``python -m bench NAME [flags]`` | ``python -m bench report``.

A benchmark run appends its records to ``bench/results/NAME.jsonl`` (``--out`` elsewhere),
prints its table and draws ``NAME.png`` beside the records; ``--from FILE`` redraws both
from records already measured. Exit 2 on a bad flag or a missing tool, 1 when a measured run
fails, each with one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import benchmarks
from bench.benchmarks import parse
from bench.core import (
    RESULTS_DIR,
    BenchError,
    RunFailed,
    describe_machine,
    machine_line,
    marks,
    noise_notes,
    read_records,
    stamp,
    write_records,
)
from bench.quiet import wait_below_cores
from xpnn.runtime import set_handoff


def run_benchmark(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Measure (or read back) one benchmark's records and draw its table and figure."""
    mod = benchmarks.load(name)
    if args.source is not None:
        if not args.source.is_file():
            raise BenchError(f"--from {args.source}: no such file")
        try:
            records = read_records(args.source, name)
        except (OSError, UnicodeDecodeError, ValueError, RecursionError, AttributeError) as e:
            why = getattr(e, "strerror", None) or type(e).__name__
            raise BenchError(f"--from {args.source}: not a records file ({why})") from None
        if not records:
            raise BenchError(f"--from {args.source}: holds no records of {name}")
        reread = getattr(mod, "reread", None)  # a benchmark that re-derives from its records
        return reread(records, args) if reread else records
    set_handoff()  # the workers' BLAS and Numba hand the cores over as `python -m xpnn`'s do
    quiet = wait_below_cores(args.quiet_wait) if args.quiet_wait else None
    machine = describe_machine()
    records = mod.run(args, machine)
    stamp(records, getattr(args, "quick", False), quiet)
    return records


def check_out(path: Path, given: bool = True) -> None:
    """Refuse a records file that cannot be written now, before measuring, not after: a
    directory, a device or a link, a folder that does not exist (only the default one is
    made)."""
    try:
        if path.is_symlink() or (path.exists() and not path.is_file()):
            what = "a directory" if path.is_dir() else "not a regular file"
            raise BenchError(f"--out {path}: is {what}; give a file name")
        if given and not path.parent.is_dir():
            raise BenchError(f"--out {path}: no such directory {path.parent}")
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as e:
        raise BenchError(f"--out {path}: cannot write there ({e.strerror or e})") from None


def show(name: str, records: list[dict[str, Any]], png: Path | None) -> None:
    mod = benchmarks.load(name)
    if records:
        print(f"{name} on {machine_line(records[0]['machine'])}\n")
    print(mod.table(records))
    notes = noise_notes(records)
    if notes:
        print(f"\n{notes}")
    if png is not None and records:
        from bench.plots import draw

        try:
            drawn = draw(png, [lambda ax: mod.plot(records, ax)], name, marks(records))
            print(f"\nplot: {drawn}")
        except ImportError as e:
            print(f"\nno plot: {e}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nbenchmarks: " + ", ".join(benchmarks.NAMES) + "; and: LIST, report")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    try:
        if name.lower() == "list":
            for n in benchmarks.NAMES:
                print(f"{n:16} {benchmarks.load(n).SUMMARY}")
            return 0
        if name == "report":
            from bench import report

            return report.main(rest)
        if name not in benchmarks.NAMES:
            raise BenchError(f"unknown benchmark {name!r}; `python -m bench LIST` names them")
        args = parse(name, rest)
        out = args.out or RESULTS_DIR / f"{name}.jsonl"
        if args.source is None:
            check_out(out, given=args.out is not None)
        records = run_benchmark(name, args)
        if args.source is None and not records:
            return 0  # it measured nothing here and said why (staging without a GPU)
        if args.source is None:
            try:
                write_records(out, records)
            except OSError as e:
                raise BenchError(f"--out {out}: cannot write ({e.strerror or e})") from None
            print(f"records: {out}")
        show(name, records, out.with_suffix(".png"))
        return 0
    except (BenchError, argparse.ArgumentTypeError) as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"bench: a measured run failed: {e}", file=sys.stderr)
        return 1
    except (MemoryError, ValueError) as e:  # --sizes far past this machine's memory
        if isinstance(e, ValueError) and "array is too big" not in str(e):  # NumPy's words
            raise
        print("bench: out of memory: give smaller sizes or counts", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError as e:  # `python -m bench NAME | head`: as python -m xpnn there
        from xpnn.runtime import stopped_from_outside

        message, code = stopped_from_outside(e) or ("stopped", 1)
        print(f"bench: {message}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
