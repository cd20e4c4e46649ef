"""Checkpoint-and-exit on a signal (Slurm's ``--signal``), agreed at a step's end, for a requeue."""

from __future__ import annotations

import math
import signal
from typing import Any

import numpy as np

from xpnn.errors import UserError
from xpnn.runtime import stall
from xpnn.runtime.failure import CollectiveExit
from xpnn.runtime.interrupts import STATE
from xpnn.train.callbacks import Callback
from xpnn.train.midepoch import write_checkpoint
from xpnn.train.trainer import Trainer, finite

REQUEUE_EXIT = 75  # sysexits.h's EX_TEMPFAIL: "a temporary failure; try again"
SIGNALS = ("USR1", "USR2")


class CheckpointOnSignal(Callback):
    """On ``SIG<name>``, end the run at the end of a step, with its checkpoint written."""

    def __init__(self, name: str, checkpoint_dir: str | None) -> None:
        if name not in SIGNALS:
            raise UserError(f"`checkpoint_signal` {name}: choose one of {', '.join(SIGNALS)}")
        if not checkpoint_dir:
            raise UserError(f"`checkpoint_signal` {name}: needs `checkpoint_dir`")
        self.signum, self.directory = getattr(signal, f"SIG{name}"), checkpoint_dir
        self.asked = self.signum in STATE["requested"]  # before this: xpnn.__main__'s note
        self.at_record = False  # agreed where a record and its checkpoint follow: they will do
        self.mpi: Any = None  # the ranks' own communicator for the question
        self.mine, self.anyone = np.zeros(1), np.zeros(1)
        self.request: Any = None
        signal.signal(self.signum, self._note)  # now: its default action ends the process

    def _note(self, signum: int, frame: Any) -> None:
        self.asked = True  # acted on where every rank can agree: the end of a step

    def on_train_begin(self, trainer: Trainer) -> None:
        world = getattr(trainer.comm, "mpi_comm", None)
        if world is not None and trainer.comm.size > 1:  # collective: every rank is here
            self.mpi = world.Dup()

    def on_step_begin(self, trainer: Trainer, step: int) -> None:
        if self.mpi is not None:  # answered while the step runs: it costs the step nothing
            self.mine[0] = float(self.asked)
            self.request = self.mpi.Iallreduce(self.mine, self.anyone)

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if self.mpi is not None:
            stall.wait(self.request, "the agreement on a checkpoint request")
            agreed = self.anyone[0] > 0
        elif trainer.comm.size > 1:  # a communicator without MPI's own: a blocking exchange
            agreed = trainer.comm.allreduce_host([float(self.asked)])[0] > 0
        else:
            agreed = self.asked
        cfg, made, per_epoch = trainer.cfg, step + 1, trainer.steps_per_epoch
        if not agreed or self.at_record or made == cfg.steps:  # (the run ends with this step)
            return
        if made % trainer.record_every == 0:
            self.at_record = True  # a record and its checkpoint follow
            return
        partial = trainer.progress.snapshot(trainer)
        what = f"checkpoint at step {made}"
        if cfg.steps is None:
            what += f" ({made % per_epoch} of epoch {made // per_epoch + 1}'s {per_epoch} steps)"
        if not all(math.isfinite(x) for row in partial["sums"] for x in row):
            return  # diverging: the record says so, and no checkpoint is written
        write_checkpoint(trainer, self.directory, cfg.keep_checkpoints, made // per_epoch, partial)
        self._stop(trainer, what)

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        # after the Checkpoints callback (the run's own come first): the record is saved
        if self.at_record and finite(record):
            by_steps = record["event"] == "eval"
            at = f"at step {record['step']}" if by_steps else f"of epoch {record['epoch']}"
            self._stop(trainer, f"checkpoint {at}")

    on_eval = on_epoch_end

    def _stop(self, trainer: Trainer, what: str) -> None:
        if trainer.is_root:
            name = signal.Signals(self.signum).name
            stop = f"stopping with exit {REQUEUE_EXIT} (continue with `resume`)"
            trainer.log(f"xpnn: {name}: {what} written; {stop}")
        raise CollectiveExit(REQUEUE_EXIT)

    def on_train_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.mpi is not None:
            self.mpi.Free()
            self.mpi = None
