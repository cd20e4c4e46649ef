"""Benchmarks that keep a script of their own in ``bench/`` (worker processes, CPU pinning, a
timer inside the training loop), run through the suite: the script's flags pass through
unchanged, and what it writes (its ``--json`` file, or for ``step_phases`` its table) becomes
records of the suite's schema.
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
    json_flag: bool = True  # False: the records come from its printed table
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
            if self.json_flag:
                head = ["--json", str(out), *head]
            stdout = run_command([*cmd, *head, *tail], args.timeout)
            print(stdout, end="")
            data = json.loads(out.read_text()) if self.json_flag else stdout
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
    """A script's own flags, and what follows ``--`` (xpnn's, for within_job)."""
    i = argv.index("--") if "--" in argv else len(argv)
    return argv[:i], argv[i:]


def _optimizer_step(d: dict[str, Any], machine: dict[str, Any]) -> list[dict[str, Any]]:
    a = d["args"]
    return [
        record(
            "optimizer_step",
            {"side": side, "optimizer": a["optimizer"], "params": a["params"]}
            | {"threads": a["threads"], "calls": a["calls"]},
            {"us_per_update": rounds},
            machine,
        )
        for side, rounds in d["rounds"].items()
    ]


def _core_contention(d: dict[str, Any], machine: dict[str, Any]) -> list[dict[str, Any]]:
    alone, together = d["seconds_per_call"]["alone"], d["seconds_per_call"]["together"]
    out = []
    for kind in alone:
        for i, cpu in enumerate(d["cpus"]):
            config = {"kernel": kind, "cpu": cpu, "cpus": d["cpus"], "work_share": d["work_share"]}
            samples = {
                "alone_ms": [1e3 * r[i] for r in alone[kind]],
                "together_ms": [1e3 * r[i] for r in together[kind]],
            }
            out.append(record("core_contention", config, samples, machine))
    return out


def _within_job(d: dict[str, Any], machine: dict[str, Any]) -> list[dict[str, Any]]:
    rounds = d["rounds"]
    config = {"a": d["a"], "b": d["b"], "common": d["common"], "ranks": d["ranks"]}
    samples = {
        "a_s": [r["a_s"] for r in rounds],
        "b_s": [r["b_s"] for r in rounds],
        "a_over_b": [r["ratio"] for r in rounds],
    }
    return [record("within_job", config, samples, machine)]


def _step_phases(stdout: str, machine: dict[str, Any]) -> list[dict[str, Any]]:
    """The script's table: a header line, a rule, one row per rank (ms per step)."""
    lines = stdout.splitlines()
    start = next(i for i, s in enumerate(lines) if s.startswith("step phases, ms per step"))
    head = lines[start + 1].split()
    out = []
    for line in lines[start + 3 :]:
        cells = line.split()
        if len(cells) != len(head) or not cells[0].isdigit():
            break
        values = dict(zip(head, cells, strict=True))
        metrics = {f"{k}_ms": [float(v)] for k, v in values.items() if k != "rank"}
        out.append(record("step_phases", {"rank": int(values["rank"])}, metrics, machine))
    return out


def _staging(stdout: str, machine: dict[str, Any]) -> list[dict[str, Any]]:
    """Its lines ``rank r/N  BYTES B  get G  mpi M  set+sync S  total T  raw d2h R  (us...)``;
    none where it skipped (no GPU)."""
    out = []
    for line in stdout.splitlines():
        cells = line.replace("raw d2h", "raw_d2h").split()
        if not line.startswith("rank ") or "get" not in cells:
            continue
        rank, size = cells[1].split("/")
        config = {"rank": int(rank), "ranks": int(size), "size_bytes": int(cells[2])}
        names = ("get", "mpi", "set+sync", "total", "raw_d2h")
        metrics = {f"{n}_us": [float(cells[cells.index(n) + 1])] for n in names}
        out.append(record("staging", config, metrics, machine))
    return out


SCRIPTS = {
    s.NAME: s
    for s in (
        Script(
            "optimizer_step",
            "one optimizer update: NumPy vs Numba vs PyTorch, microseconds",
            "optimizer_step.py",
            _optimizer_step,
            quick=["--params", "100000", "--rounds", "1", "--calls", "5", "--sides", "numpy"],
        ),
        Script(
            "core_contention",
            "a kernel alone vs on every core at once (what a shared VM costs a rank)",
            "core_contention.py",
            _core_contention,
            quick=["--kernels", "fma", "--rounds", "1", "--seconds", "0.2"],
        ),
        Script(
            "within_job",
            "two xpnn configurations in one job, epochs timed in turn (A/B)",
            "within_job.py",
            _within_job,
            quick=["--a", "", "--b", "--comm mpi-host", "--rounds", "1", "--"]
            + ["--dataset", "synthetic", "--synthetic-size", "256", "--hidden", "16"],
            ranks=2,
        ),
        Script(
            "step_phases",
            "where a training step's time goes, per rank: compute, update, fences",
            "step_phases.py",
            _step_phases,
            quick=["--dataset", "synthetic", "--synthetic-size", "512", "--hidden", "64"]
            + ["--epochs", "2", "--batch-size", "64", "--threads", "1", "--no-progress"],
            ranks=1,
            json_flag=False,
        ),
        Script(
            "staging",
            "a host-staged allreduce of device buffers, phase by phase (GPU)",
            "staging.py",
            _staging,
            quick=["--iters", "20"],
            ranks=2,
            json_flag=False,
        ),
    )
}
