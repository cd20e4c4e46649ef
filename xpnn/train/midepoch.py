"""The running sums of the span under way: a checkpoint between two records saves them too."""

import math
import time
from typing import Any

import numpy as np

from xpnn.train import checkpoint


class EpochProgress:
    """The running sums of the span under way: a checkpoint saves them, its resume restores."""

    restored: dict[str, Any] | None = None  # a resumed checkpoint's, until its span opens
    restored_epoch = -1  # the epoch whose span they carry on (by epochs)
    span: dict[str, Any] | None = None  # the span under way

    def open(self, trainer: Any, t0: float, epoch: int) -> dict[str, Any]:
        """Sums of steps begun at ``t0``, on from the resumed checkpoint's where it was written."""
        xp, restored = trainer.xp, self.restored
        span = {"t0": t0, "sent": -trainer.bytes_sent(), "samples": 0, "steps": 0}
        span |= {k: xp.zeros((), dtype=xp.float64) for k in ("loss", "correct")}
        if restored is not None and (trainer.cfg.steps is not None or epoch == self.restored_epoch):
            self.restored, rows, rank = None, restored["sums"], trainer.metrics_comm.rank
            loss, correct = 0.0, 0.0  # this rank's: its own in the same layout, else rank 0's all
            if len(rows) == trainer.metrics_comm.size:
                loss, correct = rows[rank]
            elif rank == 0 and rows:
                loss, correct = math.fsum(r[0] for r in rows), math.fsum(r[1] for r in rows)
            span["loss"] += loss  # on the device's zeros, as the trainer sums
            span["correct"] += correct
            span["t0"] -= restored["seconds"]
            span["steps"] += restored["steps"]
            span["samples"] += restored["samples"]
            if trainer.comm.rank == 0:  # the ranks' restored bytes, summed, held by one
                span["sent"] += np.array(restored["sent"], dtype=np.float64)
        self.span = span
        return span

    def snapshot(self, trainer: Any) -> dict[str, Any]:
        """What a checkpoint written now must hold of the span under way (collective)."""
        kind, span = "epoch" if trainer.cfg.steps is None else "steps", self.span
        if span is None:  # a checkpoint right after an evaluation: nothing under way
            return partial_of(kind, [], 0.0, [0.0, 0.0])
        mine = [float(span["loss"]), float(span["correct"])]
        rows = trainer.metrics_comm.allgather_obj(mine, "the gathering of the running sums")
        sent = trainer.comm.allreduce_host(span["sent"] + trainer.bytes_sent())
        seconds = time.perf_counter() - span["t0"]
        counts = () if kind == "epoch" else (span["samples"], span["steps"])
        return partial_of(kind, rows, seconds, sent, *counts)


def partial_of(
    kind: str, rows: list, seconds: float, sent: Any, samples: int = 0, steps: int = 0
) -> dict[str, Any]:
    """``meta.partial``: the running sums of an epoch or of a span of steps, by rank."""
    sent = [float(b) for b in sent]
    return dict(kind=kind, sums=rows, seconds=seconds, sent=sent, samples=samples, steps=steps)


def saved_partial(path: Any) -> dict[str, Any] | None:
    return checkpoint.checked_meta(path, checkpoint.read_npz(path), "partial")
