"""The process: its place in the job (``world``), threads per rank (``threads``), one failing
rank stopping all (``failure``, ``stall``), the last operations of each rank (``flight``),
what MPICH leaves behind (``segments``), Ctrl-C from the first instant (``interrupts``).
Names load on first use: ``interrupts`` runs before anything else is imported."""

from __future__ import annotations

import importlib

_WHERE = {
    "CollectiveExit": "failure",
    "agree_on_user_errors": "failure",
    "run_guarded": "failure",
    "stopped_from_outside": "failure",
    "peak_rss_mb": "memory",
    "wait_polled": "stall",
    "apply_threads": "threads",
    "node_cores": "threads",
    "threads_per_rank": "threads",
    "World": "world",
    "init_world": "world",
    "launch_rank": "world",
    "library_name": "world",
}
__all__ = [*_WHERE, "flight"]


def __getattr__(name: str) -> object:
    if name == "flight":
        return importlib.import_module("xpnn.runtime.flight")
    if name not in _WHERE:
        raise AttributeError(f"module 'xpnn.runtime' has no attribute {name!r}")
    module = importlib.import_module(f"xpnn.runtime.{_WHERE[name]}")
    return getattr(module, "wait" if name == "wait_polled" else name)
