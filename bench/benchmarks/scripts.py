"""Benchmarks that keep a script of their own in ``bench/`` (worker processes, CPU pinning, a
timer inside the training loop), run through the suite: the script's flags pass through
unchanged, and what it writes (its ``--json`` file) becomes records of the suite's schema.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.core import ROOT, find_mpiexec, markdown_table, record, run_command, spread

Convert = Callable[[Any, dict[str, Any]], list[dict[str, Any]]]


@dataclass
class Script:
    """One script in the registry: the attributes a benchmark module has."""

    NAME: str
    SUMMARY: str
    script: str
    convert: Convert
    quick: list[str] = field(default_factory=list)
    ranks: int = 0  # 0: plain python; N: under mpiexec -n N (``--ranks`` changes it)
    QUICK: dict[str, Any] = field(default_factory=dict)
    PASSTHROUGH: bool = True

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        if self.ranks:
            p.add_argument("--ranks", type=int, default=self.ranks, help="mpiexec -n")
        p.add_argument("--timeout", type=float, default=3600)

    def run(self, args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
        cmd = [sys.executable, str(ROOT / "bench" / self.script)]
        if getattr(args, "ranks", 0):
            cmd = [find_mpiexec(), "-n", str(args.ranks), *cmd]
        q_head, q_tail = _split(self.quick if args.quick else [])
        u_head, u_tail = _split(args.script_args)  # the user's flags after the quick ones: they win
        head = [*q_head, *u_head]
        tail = ["--", *q_tail[1:], *u_tail[1:]] if q_tail or u_tail else []
        extra = [*head, *tail]
        with tempfile.TemporaryDirectory(prefix="xpnn-bench-") as tmp:
            out = Path(tmp) / "out.json"
            print(run_command([*cmd, "--json", str(out), *head, *tail], args.timeout), end="")
            data = json.loads(out.read_text())
        records = self.convert(data, machine)
        for r in records:
            r["config"]["command"] = " ".join([Path(cmd[-1]).name, *extra])
        return records

    def table(self, records: list[dict[str, Any]]) -> str:
        if not records:
            return "no records: the script measured nothing here (its output says why)"
        keys = [k for k in (records[0]["config"] if records else {}) if k != "command"]
        metrics = list(records[0]["metrics"]) if records else []
        rows = [
            [r["config"].get(k) for k in keys] + [spread(r, m) for m in metrics] for r in records
        ]
        return markdown_table([*keys, *metrics], rows)

    def plot(self, records: list[dict[str, Any]], ax: Any) -> None:
        metric = next(iter(records[0]["metrics"])) if records else ""
        keys = [k for k in (records[0]["config"] if records else {}) if k != "command"]
        labels = [" ".join(str(r["config"][k]) for k in keys[:3])[:28] for r in records]
        ax.bar(labels, [r["metrics"][metric]["median"] for r in records])
        ax.set(ylabel=metric, title=self.NAME)
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """A script's own flags, and what follows ``--``."""
    i = argv.index("--") if "--" in argv else len(argv)
    return argv[:i], argv[i:]


def _throughput(d: dict[str, Any], machine: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for row in d["results"]:
        config = {k: row[k] for k in ("model", "backend", "batch", "threads", "steps")}
        samples = {"xpnn_samples_per_s": row["xpnn_samples_per_s_all"]}
        if row.get("torch_samples_per_s_all"):
            samples["torch_samples_per_s"] = row["torch_samples_per_s_all"]
            samples["xpnn_over_torch"] = row["ratios"]
        info = {"torch": d.get("torch"), "torch_skipped": d.get("torch_skipped")}
        info["foreign_cores"] = row.get("foreign_cores")
        out.append(record("throughput", config, samples, machine, info))
    rc = d.get("ranks_compare")
    if rc:
        config = {"model": rc["model"], "backend": f"cli {rc['ranks']} ranks x 1 thread"}
        config |= {"batch": rc["global_batch"], "threads": rc["torch_threads"], "steps": None}
        samples = {"xpnn_samples_per_s": rc["xpnn_samples_per_s_all"]}
        samples |= {"torch_samples_per_s": rc["torch_samples_per_s_all"]}
        samples |= {"xpnn_over_torch": rc["ratios"]}
        out.append(record("throughput", config, samples, machine))
    return out




SCRIPTS = {
    s.NAME: s
    for s in (
        Script(
            "throughput",
            "training samples/s of xpnn's backends beside PyTorch's (same network, same loop)",
            "throughput.py",
            _throughput,
            quick=["--steps", "2", "--warmup", "1", "--repeats", "1", "--batches", "32"]
            + ["--backends", "numpy", "--hidden", "64", "--max-foreign", "99", "--gap", "0"],
        ),
        Script(
        ),
    )
}
