"""Where one training step's time goes, per rank: compute, optimizer update, fences.

Trains once as ``python -m xpnn`` does, through ``xpnn.run.run`` (under ``mpiexec -n RANKS``;
every flag this benchmark does not know is xpnn's) with xpnn's ``PhaseTimer`` callback,
which times every step and the phases the library marks (``xpnn.record.phases``):

- ``update``: the optimizer kernels (``Optimizer.update_part``: every bucket of layers),
- ``fences``: the node-shared memory fences (``mpi-shm``), including the wait for the slowest
  rank, which is where imbalance shows,
- ``compute``: the rest of the step (batch gather, forward, loss, backward), of which
  - ``forward``: the model's forward pass (``Sequential.forward``),
  - ``wgrad``: the weight-gradient products (the GEMMs that write the gradient buffer, in
    ``Dense`` and ``Conv2D``). Where ranks share gradients their output is the size of the
    weights whatever the batch, so where the batch is split over ranks, this is where a part
    that does not shrink shows; where they share activations (``--node-share``), each rank's
    rows of it over the node's batch (forward and input-gradient products are never
    ``wgrad``).

A record per rank holds every step of the last epoch (the first one includes Numba's
compilation) and, in ``info``, the mean step: an epoch's time is the mean, which also pays for
every step a stalled core made slow. On a GPU backend (CuPy) the timer synchronizes the device
around every phase and step, so the phases add up to the step, but the step loses the overlap
of the host's launches with the device's work: compare its mean with a plain run's epoch time.

Automatic garbage collection is off while it trains: the objects Numba's first-epoch
compilation leaves make a full collection due, and a timer's own objects can tip it into the
measured epoch (one ~55 ms step, which every rank waits for).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.core import BenchError, markdown_table, median_of, record, run_worker
from bench.flags import positive_float, rank_count

NAME = "step_phases"
SUMMARY = "where a training step's time goes, per rank: compute, update, fences"
REPEATS = None  # its repeats are the run's steps (the xpnn flags it passes on)
QUICK: dict[str, Any] = {}
PASSTHROUGH = True  # the flags it does not know are xpnn's
WORKER = "bench.benchmarks.step_phases"
BASE = ["--epochs", "2", "--threads", "1", "--no-progress"]  # xpnn flags given win
QUICK_XPNN = ["--dataset", "synthetic", "--synthetic-size", "512", "--hidden", "64"]
QUICK_XPNN += ["--batch-size", "64"]
PHASES = ("step", "compute", "forward", "wgrad", "update", "fences")


def add_arguments(p: argparse.ArgumentParser) -> None:

    p.add_argument("--ranks", type=rank_count, default=1, help="mpiexec -n")
    p.add_argument(
        "--timeout", type=positive_float, default=1800, help="seconds allowed for the run"
    )


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    flags = [*BASE, *(QUICK_XPNN if args.quick else []), *args.passthrough_args]
    from xpnn.commands.flags import ArgError, build_parser

    try:
        build_parser().parse_args(flags)
    except ArgError as exc:  # xpnn's one-line usage error
        raise BenchError(str(exc)) from None
    ranks = run_worker(WORKER, args.ranks, flags, args.timeout)
    command = f"python -m bench step_phases --ranks {args.ranks} {' '.join(flags)}"
    return [
        record(NAME, {"rank": r, "ranks": args.ranks, "command": command}, samples, machine, info)
        for r, (samples, info) in enumerate(ranks)
    ]


def last_epoch(steps: list[dict[str, float]], per_epoch: int) -> tuple[dict, dict]:
    """Milliseconds of every phase of each of the last epoch's steps, and their mean step."""
    last = steps[-per_epoch:] if per_epoch else steps
    ms = {p: [1e3 * s[p] for s in last] for p in PHASES if p != "compute"}
    ms["compute"] = [1e3 * (s["step"] - s["update"] - s["fences"]) for s in last]
    return {f"{p}_ms": ms[p] for p in PHASES}, {"mean_ms": sum(ms["step"]) / len(last)}


def time_phases(argv: Sequence[str], callbacks: Sequence[Any] = ()) -> Any:
    """Train with ``python -m xpnn``'s flags ``argv`` and a ``PhaseTimer``; the timer, or
    None where training failed (xpnn said why, in flags)."""
    from xpnn.commands.flags import build_parser, flag_words, to_spec
    from xpnn.errors import worded
    from xpnn.run import launch
    from xpnn.train import PhaseTimer

    def say(line: str, err: bool = False) -> None:
        print(flag_words(line), file=sys.stderr if err else sys.stdout, flush=True)

    timer = PhaseTimer()
    spec = to_spec(build_parser().parse_args(list(argv)))  # checked before the job started
    gc.disable()  # see the module's docstring
    try:
        with worded(flag_words):
            code = launch(spec, [timer, *callbacks], log=say, warn=lambda line: say(line, True))
    finally:
        gc.enable()
    return timer if code == 0 and timer.trainer is not None and timer.steps else None


def worker(out: str, argv: Sequence[str]) -> int:
    timer = time_phases(argv)
    if timer is None:
        return 1
    trainer = timer.trainer
    rows = trainer.comm.allgather_obj(last_epoch(timer.steps, trainer.steps_per_epoch))
    if trainer.comm.rank == 0:
        Path(out).write_text(json.dumps(rows))
    return 0


def table(records: list[dict[str, Any]]) -> str:
    if not records:
        return "no records"
    heads = ["rank", "mean", *PHASES]
    rows = [
        [r["config"]["rank"], r["info"]["mean_ms"], *(median_of(r, f"{p}_ms") for p in PHASES)]
        for r in records
    ]
    steps = records[0]["repeats"]
    return (
        f"ms per step: the median over the last epoch's {steps} steps, and their mean\n\n"
        + markdown_table(heads, rows)
    )


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    """A stacked bar per rank: compute, update and fences (the step's parts)."""
    ranks = [str(r["config"]["rank"]) for r in records]
    bottom = [0.0] * len(records)
    for p in ("compute", "update", "fences"):
        heights = [median_of(r, f"{p}_ms") for r in records]
        ax.bar(ranks, heights, bottom=bottom, label=p)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.set(xlabel="rank", ylabel="ms per step (median)", title="step phases")
    ax.legend(fontsize=7)


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1], sys.argv[2:]))
