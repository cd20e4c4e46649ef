"""Where one training step's time goes, per rank: compute, optimizer update, fences.

Runs ``python -m xpnn`` with the arguments given, under whatever launched it (plain python for
one rank, ``mpiexec -n N`` for N), with timers around the phases of ``Trainer.step``:

- ``update``: the optimizer kernels (``Optimizer.update_part``: every bucket of layers),
- ``fences``: the node-shared memory fences (``mpi-shm``), including the wait for the slowest
  rank, which is where imbalance shows,
- ``compute``: the rest of the step (batch gather, forward, loss, backward), of which
  - ``forward``: the model's forward pass (``Sequential.forward``),
  - ``wgrad``: the weight-gradient products (``matmul_into``, the GEMMs that write the gradient
    buffer). Where ranks share gradients their output is the size of the weights whatever
    the batch, so where the batch is split over ranks, this is where a part that does not
    shrink shows; where they share activations (``--node-share``), each rank's rows of it
    over the node's batch (where they also split the wide layers' forward and input-gradient
    products by units, those products call ``matmul_into`` too, and count as ``forward``
    or not at all, never as ``wgrad``; so do a ``Conv2D``'s forward and input-gradient
    products);

and prints, for each rank, the median per step over the last epoch (the first one includes
Numba's compilation), and the mean step: an epoch's time is the mean, which also pays for every
step a stalled core made slow. Timing wraps methods only; nothing in the step changes on the
CPU. On a GPU backend (CuPy) a timer that only read the clock would time kernel launches, so
there every phase and step synchronizes the device before and after it. Then the phases add up
to the step, but the step loses the overlap of the host's launches with the device's work:
compare its mean with the epoch time of a plain run.

Automatic garbage collection is off while it trains. Plain runs of this MLP make no full
collection in their first epochs, but the objects Numba's first-epoch compilation leaves make
one due, and this script's wrappers tipped it into the measured epoch: one ~55 ms step, which
both ranks wait for, in each of six 2-rank runs (~0.1 ms on the mean step).

Run: ``mpiexec -n 2 python bench/step_phases.py --backend numba --hidden 1024,1024 --threads 1
--epochs 2`` (any ``python -m xpnn`` arguments; as there, the backend defaults to numpy,
whose Adam takes ~4x as long as numba's on this model).
"""

from __future__ import annotations

import gc
import sys
import time
from typing import Any

from _common import Parser, format_table, median, run_main

PHASES = ("update", "fences", "forward", "wgrad")


class StepTimer:
    """Per-step seconds of each phase, filled by wrapped methods."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] | None = None
        self.muted = 0  # inside a method whose own calls are not phases
        self.sync: Any = None  # the device's synchronize, on a GPU backend

    def mute(self, cls: Any, name: str) -> None:
        """Phases called from inside ``cls.name`` do not count."""
        inner = getattr(cls, name)
        timer = self

        def muted(*args: Any, **kwargs: Any) -> Any:
            timer.muted += 1
            try:
                return inner(*args, **kwargs)
            finally:
                timer.muted -= 1

        setattr(cls, name, muted)

    def wrap(self, cls: Any, name: str, phase: str | None) -> None:
        """Time ``cls.name``: as a phase of the running step, or (phase None) as the step."""
        inner = getattr(cls, name)
        timer = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            if timer.muted:
                return inner(*args, **kwargs)
            if phase is None:
                timer.current = dict.fromkeys(PHASES, 0.0)
            if timer.sync:
                timer.sync()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if timer.sync:
                    timer.sync()
                elapsed = time.perf_counter() - t0
                if phase is None:
                    timer.current["step"] = elapsed
                    timer.steps.append(timer.current)
                    timer.current = None
                elif timer.current is not None:
                    timer.current[phase] += elapsed

        setattr(cls, name, timed)

    def last_epoch(self, steps_per_epoch: int) -> dict[str, float]:
        """Median milliseconds per step of each phase over the last epoch's steps."""
        last = self.steps[-steps_per_epoch:] if steps_per_epoch else self.steps
        out = {p: 1e3 * median([s[p] for s in last]) for p in (*PHASES, "step")}
        out["compute"] = 1e3 * median([s["step"] - s["update"] - s["fences"] for s in last])
        out["mean"] = 1e3 * sum(s["step"] for s in last) / len(last)  # stalls count here
        out["steps"] = len(last)
        return out


def device_sync(backend: Any) -> Any:
    """What the timers wait for the device with: its synchronize on a GPU backend, else None
    (on the CPU a call has finished its work when it returns)."""
    return backend.synchronize if backend.is_gpu else None


def help_parser() -> Parser:
    """Only for ``--help``: every argument goes to ``python -m xpnn``, which checks them."""
    return Parser(
        prog="step_phases.py",
        usage="[mpiexec -n N] python bench/step_phases.py [python -m xpnn arguments]",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog="Any python -m xpnn arguments (python -m xpnn --help lists them); the table is "
        "the median per step over the last epoch, so give --epochs 2 or more.",
    )


def instrument(timer: StepTimer) -> None:
    """Wrap the step and its phases' methods (for good: this script trains once)."""
    from xpnn import optim, train
    from xpnn.backends import cupy_kernels, kernels, numpy_kernels
    from xpnn.nn.conv import Conv2D
    from xpnn.nn.dense import Dense
    from xpnn.nn.sequential import Sequential
    from xpnn.parallel import shm_comm

    timer.wrap(train.Trainer, "step", None)
    timer.wrap(optim.Optimizer, "update_part", "update")
    timer.wrap(shm_comm.ShmCommunicator, "fence", "fences")
    timer.wrap(Sequential, "forward", "forward")
    # neither calls another (CuPy's is NumPy's function, bound to its own class)
    for cls in (kernels.Kernels, numpy_kernels.NumpyKernels, cupy_kernels.CupyKernels):
        timer.wrap(cls, "matmul_into", "wgrad")
    for cls, name in (  # products, not weight gradients
        (Dense, "forward_units"),
        (Dense, "input_grad_rows"),
        (Conv2D, "forward"),  # its product counts as forward (within Sequential.forward)
        (Conv2D, "input_grad"),  # before the 19th session a CNN's wgrad counted both
    ):
        timer.mute(cls, name)


def main(argv: list[str]) -> int:
    if "-h" in argv or "--help" in argv:
        help_parser().print_help()
        return 0
    from xpnn import cli, train

    timer = StepTimer()
    instrument(timer)
    trainers: list[Any] = []
    init = train.Trainer.__init__

    def remember(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        trainers.append(self)
        timer.sync = device_sync(self.backend)

    train.Trainer.__init__ = remember
    gc.disable()  # see the module's docstring
    try:
        code = cli.main(argv)
    finally:
        gc.enable()
    if code != 0 or not trainers or not timer.steps:
        return code or 1
    trainer = trainers[0]
    mine = timer.last_epoch(trainer.steps_per_epoch)
    rows = trainer.comm.allgather_obj(mine)
    if trainer.comm.rank == 0:
        print(f"\nstep phases, ms per step (median over the last epoch's {mine['steps']} steps):")
        cols = ("mean", "step", "compute", "forward", "wgrad", "update", "fences")
        table = [[str(r), *(f"{row[c]:.3f}" for c in cols)] for r, row in enumerate(rows)]
        print(format_table(("rank", *cols), table))
    return 0


if __name__ == "__main__":
    run_main(lambda: main(sys.argv[1:]))
