"""Checkpoint-and-exit on request, for jobs longer than their time limit (Slurm's
``--signal=USR1@120``): the signal is noted, the ranks agree at the end of the epoch under way,
its checkpoint is written as every epoch's is, and every rank leaves with ``REQUEUE_EXIT``,
which a requeue script tests before it resubmits the job with ``--resume``."""

from __future__ import annotations

import math
import signal
from typing import TYPE_CHECKING, Any

import numpy as np

from xpnn.errors import UserError
from xpnn.runtime.failure import CollectiveExit
from xpnn.train.callbacks import Callback

if TYPE_CHECKING:
    from xpnn.train.trainer import Trainer

REQUEUE_EXIT = 75  # sysexits.h's EX_TEMPFAIL: "a temporary failure; try again"
SIGNALS = ("USR1", "USR2")


class CheckpointOnSignal(Callback):
    """On ``SIG<name>``, end the run after the current epoch's checkpoint."""

    def __init__(self, name: str, checkpoint_dir: str | None) -> None:
        if name not in SIGNALS:
            raise UserError(f"`checkpoint_signal` {name}: choose one of {', '.join(SIGNALS)}")
        if not checkpoint_dir:
            raise UserError(f"`checkpoint_signal` {name}: needs `checkpoint_dir`")
        self.signum = getattr(signal, f"SIG{name}")
        self.asked = False
        signal.signal(self.signum, self._note)  # now: its default action ends the process

    def _note(self, signum: int, frame: Any) -> None:
        self.asked = True  # acted on where every rank can agree: the end of an epoch

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        # after the Checkpoints callback (the run's own come first): the epoch is saved
        asked = trainer.comm.allreduce_host(np.array([float(self.asked)]))[0] > 0
        if not asked or not math.isfinite(record["train_loss"] + record["test_loss"]):
            return
        if trainer.is_root:
            name = signal.Signals(self.signum).name
            trainer.log(
                f"xpnn: {name}: checkpoint of epoch {record['epoch']} written; stopping with "
                f"exit {REQUEUE_EXIT} (continue with `resume`)"
            )
        raise CollectiveExit(REQUEUE_EXIT)
