"""The registry: each benchmark is a module with NAME, SUMMARY, QUICK (the sizes of a quick
run), ``add_arguments(parser)``, ``run(args, machine) -> records``, ``table(records)`` and
``plot(records, ax)``; ``REPEATS`` names the flag counting its repeats when not ``--repeats``
(None: no repeats of its own). A module with ``PASSTHROUGH = True`` gets the flags it does
not know in ``args.passthrough_args`` (step_phases hands them to ``python -m xpnn``)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from bench.core import BenchError
from bench.flags import add_common, file_path

NAMES = (
    "scaling",
    "cnn",
    "granularity",
    "batch_regimes",
    "parallel_modes",
    "crossover",
    "allreduce",
    "polling",
    "gemm_split",
    "throughput",
    "optimizer_step",
    "core_contention",
    "within_job",
    "step_phases",
    "staging",
    "gpt",
    "trace_cost",
    "plan_accuracy",
    "limit",
    "python_loop",
)


def load(name: str) -> ModuleType:
    """The benchmark's module."""
    return importlib.import_module(f"bench.benchmarks.{name}")


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line naming it (``bench: --rounds: must be >= 1``, exit 2), no usage."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        raise BenchError(message.removeprefix("argument "))


def _parser(mod: Any, prog: str) -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description=mod.SUMMARY, allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    p.add_argument("--out", type=file_path, help="records file (default bench/results/NAME.jsonl)")
    p.add_argument("--from", dest="source", type=Path, help="redraw from this records file")
    mod.add_arguments(p)
    add_common(p, getattr(mod, "REPEATS", "repeats"))
    return p


def parse(name: str, argv: Sequence[str], quick: bool = False) -> argparse.Namespace:
    mod = load(name)
    p = _parser(mod, f"python -m bench {name}")
    if quick or "--quick" in argv:
        p.set_defaults(**mod.QUICK, quick=True)  # explicit flags still win
    if not getattr(mod, "PASSTHROUGH", False):
        return p.parse_args(list(argv))
    args, rest = p.parse_known_args(list(argv))
    args.passthrough_args = rest  # flags for what the benchmark runs (xpnn), unchanged
    return args
