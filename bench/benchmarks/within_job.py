"""Two xpnn configurations in one job, their training epochs timed in turn (ABBA).

On a shared machine, runs made minutes apart differ by more than most changes worth measuring
(here, identical 2-rank runs differ by up to 1.6x in speed), so this does not launch one run
per side as the other training benchmarks do. One ``mpiexec`` job builds a trainer per side
(each with its own model, data and buffers, from the same seed) and times whole training
epochs of the two in turn, A B, then B A, and so on, after one untimed epoch of each (Numba's
compilation, first touches): both sides see the same minutes of the machine. Only training
steps are timed: no evaluation, logging or saving. A / B above 1 means B is faster.

What it cannot remove is the job's own luck (most likely where its buffers land in memory):
with both sides the same, per-job median ratios ranged from 0.97 to 1.02 on a 2-core AMD EPYC
VM. Run the job several times, with an A/A job beside them, and look at the spread.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from bench.core import BenchError, markdown_table, median_of, record, run_worker, spread
from bench.flags import data_dir_problem, positive_float, positive_int, rank_count

NAME = "within_job"
SUMMARY = "two xpnn configurations in one job, epochs timed in turn (A/B)"
REPEATS = "rounds"  # the flag counting its repeats
QUICK = {
    "b": "--comm mpi-host",
    "rounds": 1,
    "common": ["--dataset", "synthetic", "--synthetic-size", "256", "--hidden", "16"],
}
WORKER = "bench.benchmarks.within_job"
SIDES = ("a", "b")
IGNORED = {
    "epochs": "--rounds sets the timed epochs",
    "save": "nothing is saved",
    "metrics": "no metrics are written",
    "checkpoint_dir": "no checkpoints are written",
    "resume": "both sides start afresh",
}
"""xpnn flags that this benchmark does not act on (it times training steps only), and why."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=rank_count, default=2, help="mpiexec -n")
    for side in SIDES:
        p.add_argument(f"--{side}", default="", help=f"xpnn flags side {side.upper()} adds, "
                       f"one quoted string (--{side}=--flag for a flag alone)")  # fmt: skip
    p.add_argument("--rounds", type=positive_int, default=6, help="timed epochs of each side")
    p.add_argument(
        "--timeout", type=positive_float, default=3600, help="seconds allowed for the job"
    )
    p.add_argument("common", nargs="*", metavar="-- XPNN_FLAGS", help="flags both sides share")


def sides_of(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each side's added xpnn flags, checked as xpnn checks them, before any job starts (a
    trainer would create files): a problem is named where it was given, ``--a``, ``--b`` or
    after ``--``."""
    from xpnn.commands.flags import ArgError, build_parser

    sides = {}
    for s in SIDES:
        try:
            sides[s] = shlex.split(getattr(args, s))
        except ValueError as exc:
            raise BenchError(f"--{s}: {exc}") from None
    if sides["a"] == sides["b"]:
        raise BenchError("--a and --b give the same arguments: nothing to compare")
    parser = build_parser()

    def parse(flags: list[str], where: str) -> argparse.Namespace:
        try:
            return parser.parse_args(flags)
        except ArgError as exc:
            raise BenchError(where.format(exc)) from None

    defaults, common = parser.parse_args([]), parse(args.common, "{} (after --)")
    mine = {s: parse([*args.common, *sides[s]], f"--{s}: {{}}") for s in SIDES}
    for dest, why in IGNORED.items():
        flag = "--" + dest.replace("_", "-")
        if getattr(common, dest) != getattr(defaults, dest):
            raise BenchError(f"{flag} (after --): not used here, {why}")
        for s in SIDES:
            if getattr(mine[s], dest) != getattr(common, dest):
                raise BenchError(f"--{s}: {flag}: not used here, {why}")
    for s, side in mine.items():
        given = side.data_dir and side.dataset != "synthetic"
        problem = given and data_dir_problem(side.dataset, side.data_dir)
        if problem:
            shared = (common.dataset, common.data_dir) == (side.dataset, side.data_dir)
            raise BenchError(f"{problem} (after --)" if shared else f"--{s}: {problem}")
    return sides


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    sides = sides_of(args)
    flags = json.dumps({"common": args.common, **sides})
    got = run_worker(WORKER, args.ranks, [str(args.rounds), flags], args.timeout)
    for s in SIDES:  # what python -m xpnn would note, per side
        for note in got["notes"][s]:
            print(f"bench: note: --{s}: {note}", file=sys.stderr)
    ratios = [a / b for a, b in zip(got["a_s"], got["b_s"], strict=True)]
    config = {"a": sides["a"], "b": sides["b"], "common": args.common, "ranks": got["ranks"]}
    samples = {"a_s": got["a_s"], "b_s": got["b_s"], "a_over_b": ratios}
    info = {"orders": got["orders"], "notes": got["notes"]}
    return [record(NAME, config, samples, machine, info)]


def _epoch(trainer: Any, epoch: int) -> float:
    """Seconds of one epoch of training steps, every rank starting and ending together."""
    from xpnn.data import global_batches

    batches = global_batches(trainer.n_train, trainer.cfg.batch_size, trainer.cfg.seed, epoch)
    trainer.comm.barrier()
    start = time.perf_counter()
    trainer.train_epoch(epoch, batches)
    trainer.backend.synchronize()
    trainer.comm.barrier()
    return time.perf_counter() - start


def _compare(out: str, rounds: int, specs: dict[str, Any], world: Any) -> int:
    from xpnn.commands.flags import flag_words
    from xpnn.run import build_run, notes

    trainers = {s: build_run(specs[s], world) for s in SIDES}
    said = {s: [flag_words(n) for n in notes(specs[s], trainers[s], world)] for s in SIDES}
    times: dict[str, list[float]] = {s: [] for s in SIDES}
    orders = []
    for r in range(rounds + 1):  # round 0: untimed warm-up of both
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for s in order:
            seconds = _epoch(trainers[s], r)
            if r:
                times[s].append(seconds)
        if r:
            orders.append("".join(order).upper())
    if world.rank == 0:
        got = {"ranks": world.size, "orders": orders, "notes": said}
        Path(out).write_text(json.dumps(got | {f"{s}_s": times[s] for s in SIDES}))
    return 0


def worker(out: str, rounds: int, flags: dict[str, list[str]]) -> int:
    """One rank of the job: both trainers, their epochs in turn; rank 0 writes ``out``."""
    from xpnn.commands.flags import build_parser, flag_words, to_spec
    from xpnn.errors import UserError, worded
    from xpnn.runtime import init_world, run_guarded

    parser = build_parser()
    specs = {s: to_spec(parser.parse_args([*flags["common"], *flags[s]])) for s in SIDES}
    try:
        world = init_world()
    except UserError as exc:
        print(f"within_job: {flag_words(str(exc))}", file=sys.stderr)
        return 2
    with worded(flag_words):
        return run_guarded(world, lambda: _compare(out, rounds, specs, world))


def _words(flags: list[str], empty: str) -> str:
    return " ".join(flags) or empty


def table(records: list[dict[str, Any]]) -> str:
    rows = []
    for r in records:
        c, ratios = r["config"], r["metrics"]["a_over_b"]["samples"]
        rows.append([_words(c["a"], "(nothing added)"), _words(c["b"], "(nothing added)"),
                     _words(c["common"], "(xpnn defaults)"), c["ranks"], spread(r, "a_s"),
                     spread(r, "b_s"), spread(r, "a_over_b"),
                     f"{sum(q > 1 for q in ratios)} of {len(ratios)}"])  # fmt: skip
    heads = ["A adds", "B adds", "both", "ranks", "A s / epoch", "B s / epoch", "A / B"]
    heads.append("rounds B faster")
    lines = [markdown_table(heads, rows), ""]
    for r in records:
        m = median_of(r, "a_over_b")
        lines.append(f"median A / B {m:.3f}: {'B' if m > 1 else 'A'} faster by "
                     f"{abs(m - 1) * 100:.1f} %")  # fmt: skip
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    for i, r in enumerate(records):
        ratios = r["metrics"]["a_over_b"]["samples"]
        ax.plot([i] * len(ratios), ratios, "o", alpha=0.5)
        ax.plot([i], [median_of(r, "a_over_b")], "k_", markersize=20)
    labels = [f"{_words(r['config']['a'], '-')} /\n{_words(r['config']['b'], '-')}"[:40]
              for r in records]  # fmt: skip
    ax.set_xticks(range(len(records)), labels, fontsize=7)
    ax.axhline(1, color="r", ls=":")
    ax.set(ylabel="A / B epoch time (above 1: B faster)", title="within job A/B")


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])))
