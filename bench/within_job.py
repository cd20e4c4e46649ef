"""Two xpnn configurations in one job, their training epochs timed in turn (ABBA).

On a shared machine, runs made minutes apart differ by more than most changes worth measuring
(here, identical 2-rank runs differ by up to 1.6x in speed). This script builds one trainer per
configuration inside the same ``mpiexec`` job (each with its own model, data and buffers, from
the same seed) and times whole training epochs of the two in turn, A B, then B A, and so on,
after one untimed epoch of each (Numba's compilation, first touches). Both sides then see the
same minutes of the machine. It prints each round's epoch times and their ratio A / B, and the
median ratio: above 1 means B is faster.

What it cannot remove is the job's own luck (most likely where its buffers land in memory):
with both sides the same, per-job median ratios ranged from 0.97 to 1.02 on a 2-core AMD EPYC VM.
Run the job several times, with an A/A job beside them, and look at the spread.

Run: ``mpiexec -n 2 python bench/within_job.py --a "--comm mpi-shm" --b "--comm mpi-host"
--rounds 6 -- --backend numba --hidden 1024,1024 --threads 1`` (after ``--``: the xpnn
arguments both sides share; ``--a`` and ``--b``: what each adds). Only training steps are
timed: no evaluation, logging or saving.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from typing import Any

from _common import (
    Parser,
    data_dir_problem,
    fmt_num,
    format_table,
    launch_rank,
    median,
    out_path,
    positive_int,
    refuse_unwritable,
    run_main,
    write_json,
)

SIDES = ("a", "b")
IGNORED = {
    "epochs": "--rounds sets the timed epochs",
    "save": "nothing is saved",
    "metrics": "no metrics are written",
    "checkpoint_dir": "no checkpoints are written",
    "resume": "both sides start afresh",
}
"""xpnn flags this script does not act on (it times training steps only), and why."""


def glued(argv: list[str]) -> list[str]:
    """``--a X`` as ``--a=X``: a side's arguments are one word that may itself start with
    ``--`` (``--a --recompute``), which argparse would take for a flag of its own."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in ("--a", "--b") and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    """This script's flags before ``--``, the shared xpnn arguments after it."""
    split = argv.index("--") if "--" in argv else len(argv)
    p = Parser(
        description="Two xpnn configurations in one job, epochs timed in turn.",
        usage="within_job.py [--a ARGS] [--b ARGS] [--rounds N] [--json PATH] -- [xpnn args]",
    )
    p.add_argument("--a", default="", help="xpnn arguments of side A (one quoted string)")
    p.add_argument("--b", default="", help="xpnn arguments of side B (one quoted string)")
    p.add_argument("--rounds", type=positive_int, default=6, help="timed epochs of each side")
    p.add_argument("--json", type=out_path, help="also write the rounds here")
    args = p.parse_args(glued(argv[:split]))
    args.common = argv[split + 1 :]
    if args.json:
        refuse_unwritable(p, "--json", args.json)
    for side in SIDES:
        try:
            extra = shlex.split(getattr(args, side))
        except ValueError as exc:
            p.error(f"--{side}: {exc}")
        setattr(args, side, extra)
    if args.a == args.b:
        p.error("--a and --b give the same arguments: nothing to compare")
    return args


def _usage_error(message: str) -> int:
    if launch_rank() == 0:  # every rank found the same: one says it
        print(f"within_job.py: error: {message}", file=sys.stderr)
    return 2


def side_problem(opts: argparse.Namespace, sides: dict[str, argparse.Namespace]) -> str | None:
    """What is wrong with the sides' xpnn arguments beyond their syntax, found before MPI and
    any trainer (which would create files): an xpnn flag this script does not act on
    (``IGNORED``), or a ``--data-dir`` without the data set. Named where it was given: in the
    shared arguments (after ``--``) or in one side's."""
    from xpnn import cli

    parser = cli.build_parser()
    defaults = parser.parse_args([])
    common = parser.parse_args(opts.common)  # parsed with each side already: it parses
    for dest, why in IGNORED.items():
        flag = "--" + dest.replace("_", "-")
        if getattr(common, dest) != getattr(defaults, dest):
            return f"{flag} (after --): not used here, {why}"
        for s in SIDES:
            if getattr(sides[s], dest) != getattr(common, dest):
                return f"--{s}: {flag}: not used here, {why}"
    for s in SIDES:
        args = sides[s]
        if args.dataset == "synthetic" or args.data_dir is None:
            continue
        problem = data_dir_problem(args.dataset, args.data_dir)
        if problem:
            shared = (common.dataset, common.data_dir) == (args.dataset, args.data_dir)
            return f"{problem} (after --)" if shared else f"--{s}: {problem}"
    return None


def train_epoch(trainer: Any, epoch: int) -> float:
    """Seconds of one epoch of training steps, every rank starting and ending together."""
    from xpnn.data import global_batches

    batches = global_batches(trainer.n_train, trainer.cfg.batch_size, trainer.cfg.seed, epoch)
    trainer.comm.barrier()
    start = time.perf_counter()
    trainer.train_epoch(epoch, batches)
    trainer.backend.synchronize()
    trainer.comm.barrier()
    return time.perf_counter() - start


def compare(opts: argparse.Namespace, sides: dict[str, argparse.Namespace], world: Any) -> int:
    from xpnn.cli import flag_words, to_spec
    from xpnn.run import build_run, ineffective_settings

    specs = {s: to_spec(sides[s]) for s in SIDES}
    trainers = {s: build_run(specs[s], world) for s in SIDES}
    for s in SIDES if world.rank == 0 else ():  # what python -m xpnn would note, per side
        for name, why in ineffective_settings(specs[s], trainers[s].groups):
            note = flag_words(f"{name} has no effect {why}")
            print(f"within_job.py: note: --{s}: {note}", file=sys.stderr)
    times: dict[str, list[float]] = {s: [] for s in SIDES}
    orders = []
    for r in range(opts.rounds + 1):  # round 0: untimed warm-up of both
        order = SIDES if r % 2 == 0 else SIDES[::-1]
        for s in order:
            seconds = train_epoch(trainers[s], r)
            if r:
                times[s].append(seconds)
        if r:
            orders.append("".join(order).upper())
    if world.rank != 0:
        return 0
    ratios = [a / b for a, b in zip(times["a"], times["b"], strict=True)]
    a_line, b_line = (" ".join(getattr(opts, s)) or "(nothing added)" for s in SIDES)
    print(f"A: {a_line}\nB: {b_line}\nboth: {' '.join(opts.common) or '(xpnn defaults)'}")
    print(f"{world.size} rank(s); seconds per training epoch, after one untimed epoch each\n")
    rows = [
        [str(i + 1), order, fmt_num(a), fmt_num(b), f"{q:.3f}"]
        for i, (order, a, b, q) in enumerate(
            zip(orders, times["a"], times["b"], ratios, strict=True)
        )
    ]
    print(format_table(("round", "order", "A (s)", "B (s)", "A / B"), rows))
    m = median(ratios)
    faster = "B" if m > 1 else "A"
    print(
        f"\nmedian A {fmt_num(median(times['a']))} s, B {fmt_num(median(times['b']))} s; "
        f"median ratio A / B {m:.3f}: {faster} faster by {abs(m - 1) * 100:.1f} % "
        f"({sum(q > 1 for q in ratios)} of {len(ratios)} rounds favour B)"
    )
    if opts.json:
        write_json(
            opts.json,
            {
                "benchmark": "within_job",
                "a": opts.a,
                "b": opts.b,
                "common": opts.common,
                "ranks": world.size,
                "rounds": [
                    {"order": o, "a_s": a, "b_s": b, "ratio": q}
                    for o, a, b, q in zip(orders, times["a"], times["b"], ratios, strict=True)
                ],
                "median_ratio": m,
            },
        )
        print(f"wrote {opts.json}")
    return 0


def main(argv: list[str]) -> int:
    opts = parse(argv)
    from xpnn import cli
    from xpnn.errors import UserError
    from xpnn.runtime import init_world, run_guarded

    sides = {}
    for s in SIDES:
        try:
            sides[s] = cli.build_parser().parse_args([*opts.common, *getattr(opts, s)])
        except cli._ArgError as exc:
            return _usage_error(f"--{s}: {exc}")
    problem = side_problem(opts, sides)
    if problem:  # refused before any trainer is built: nothing is created for nothing
        return _usage_error(problem)
    try:
        world = init_world()
    except UserError as exc:
        return _usage_error(cli.flag_words(str(exc)))
    return run_guarded(world, lambda: compare(opts, sides, world))


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1:]))
