"""Where one training step's time goes, per rank: compute, optimizer update, fences.

Runs ``python -m xpnn`` with the arguments given, under whatever launched it (plain python for
one rank, ``mpiexec -n N`` for N), with xpnn's ``PhaseTimer`` callback, which times every step
and the phases the library marks (``xpnn.phases``):

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
    ``wgrad``);

and prints, for each rank, the median per step over the last epoch (the first one includes
Numba's compilation), and the mean step: an epoch's time is the mean, which also pays for every
step a stalled core made slow. Nothing in the step changes on the CPU. On a GPU backend (CuPy)
a timer that only read the clock would time kernel launches, so there every phase and step
synchronizes the device before and after it. Then the phases add up
to the step, but the step loses the overlap of the host's launches with the device's work:
compare its mean with the epoch time of a plain run.

Automatic garbage collection is off while it trains. Plain runs of this MLP make no full
collection in their first epochs, but the objects Numba's first-epoch compilation leaves make
one due, and a timer's own objects can tip it into the measured epoch: one ~55 ms step, which
both ranks wait for, in each of six 2-rank runs (~0.1 ms on the mean step).

Run: ``mpiexec -n 2 python bench/step_phases.py --backend numba --hidden 1024,1024 --threads 1
--epochs 2`` (any ``python -m xpnn`` arguments; as there, the backend defaults to numpy,
whose Adam takes ~4x as long as numba's on this model).
"""

from __future__ import annotations

import gc
import sys

from _common import Parser, format_table, median, run_main

PHASES = ("update", "fences", "forward", "wgrad")


def last_epoch(steps: list[dict[str, float]], steps_per_epoch: int) -> dict[str, float]:
    """Median milliseconds per step of each phase over the last epoch's steps."""
    last = steps[-steps_per_epoch:] if steps_per_epoch else steps
    out = {p: 1e3 * median([s[p] for s in last]) for p in (*PHASES, "step")}
    out["compute"] = 1e3 * median([s["step"] - s["update"] - s["fences"] for s in last])
    out["mean"] = 1e3 * sum(s["step"] for s in last) / len(last)  # stalls count here
    out["steps"] = len(last)
    return out


def help_parser() -> Parser:
    """Only for ``--help``: every argument goes to ``python -m xpnn``, which checks them."""
    return Parser(
        prog="step_phases.py",
        usage="[mpiexec -n N] python bench/step_phases.py [python -m xpnn arguments]",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Any python -m xpnn arguments (python -m xpnn --help lists them); the table is "
        "the median per step over the last epoch, so give --epochs 2 or more.",
    )


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        help_parser().print_help()
        return 0
    from xpnn import cli
    from xpnn.train import PhaseTimer

    timer = PhaseTimer()
    gc.disable()  # see the module's docstring
    try:
        code = cli.main(argv, callbacks=[timer])
    finally:
        gc.enable()
    trainer = timer.trainer
    if code != 0 or trainer is None or not timer.steps:
        return code or 1
    mine = last_epoch(timer.steps, trainer.steps_per_epoch)
    rows = trainer.comm.allgather_obj(mine)
    if trainer.comm.rank == 0:
        print(f"\nstep phases, ms per step (median over the last epoch's {mine['steps']} steps):")
        cols = ("mean", "step", "compute", "forward", "wgrad", "update", "fences")
        table = [[str(r), *(f"{row[c]:.3f}" for c in cols)] for r, row in enumerate(rows)]
        print(format_table(("rank", *cols), table))
    return 0


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1:]))
