"""Callbacks the ``Trainer`` calls at its events, on every rank (one that writes checks
``trainer.is_root``); step events go only to the callbacks that override them."""

from __future__ import annotations

import math
import os
import time
from typing import TYPE_CHECKING, Any

from xpnn import phases
from xpnn.checkpoint import KEEP_CHECKPOINTS, prune_checkpoints, save_checkpoint
from xpnn.errors import UserError, path_problems
from xpnn.parallel.model.whole import is_spread, whole_arrays, whole_params
from xpnn.runtime import stall
from xpnn.runtime.threads import describe_threads
from xpnn.train import metrics_file

if TYPE_CHECKING:
    from xpnn.train.trainer import Trainer


class Callback:
    """Does nothing at every event: a subclass overrides the events it needs."""

    def on_train_begin(self, trainer: Trainer) -> None:
        """Before the first epoch (after a resume, before its first epoch left)."""

    def on_epoch_begin(self, trainer: Trainer, epoch: int) -> None:
        """``epoch`` counts from 0; called inside the epoch's timed span."""

    def on_step_begin(self, trainer: Trainer, step: int) -> None:
        """``step`` counts every global batch of the run from 0."""

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        """After the step's update: the parameters are the next step's."""

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """``record``: the epoch's metrics line (DESIGN.md's contract)."""

    def on_eval(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """Training by ``steps``: ``record`` (``"event"`` ``"eval"``) every ``eval_every``."""

    def on_train_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """``record``: the run's last line, ``"event"`` ``"done"`` or ``"diverged"``."""


def overrides(callback: Callback, event: str) -> bool:
    return getattr(type(callback), event) is not getattr(Callback, event)


class MetricsFile(Callback):
    """The JSON-lines metrics file (rank 0), emptied by a fresh run; not finite is null."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_begin(self, trainer: Trainer) -> None:
        if not trainer.is_root:
            return
        with path_problems("metrics", self.path):
            metrics_file.check_metrics_file(self.path)  # never empty another file
            if trainer.start_epoch == 0:  # a fresh run, a fresh file
                open(self.path, "w").close()
            else:  # each epoch once: what came after the resumed checkpoint goes
                metrics_file.keep_until(self.path, trainer.start_epoch)

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if not trainer.is_root:
            return
        line = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in record.items()}  # fmt: skip
        with path_problems("metrics", self.path):
            metrics_file.append_record(self.path, line)

    on_train_end = on_epoch_end  # the run's last line, written as an epoch's
    on_eval = on_epoch_end


class EpochLog(Callback):
    """A line per epoch and one at the end, printed by rank 0 through ``log``."""

    def __init__(self, log: Any) -> None:
        self.log = log

    def on_epoch_end(self, trainer: Trainer, r: dict[str, Any]) -> None:
        if not trainer.is_root:
            return
        first = r["epoch"] == trainer.start_epoch + 1
        where = f"  [{r['backend']}, comm {r['comm']}, {r['world_size']} rank(s)"
        if "threads" in r:
            where += f" x {describe_threads(r)}"
        self.log(
            f"epoch {r['epoch']}/{trainer.cfg.epochs}  train_loss {r['train_loss']:.4f}  "
            f"test_loss {r['test_loss']:.4f}  test_acc {r['test_acc']:.4f}  "
            f"{r['seconds']:.1f} s  {r['samples_per_s']:.0f} samples/s"
            + (where + "]" if first else "")
        )

    def on_eval(self, trainer: Trainer, r: dict[str, Any]) -> None:
        if trainer.is_root:
            self.log(
                f"step {r['step']}/{trainer.cfg.steps}  train_loss {r['train_loss']:.4f}  "
                f"test_loss {r['test_loss']:.4f}  test_acc {r['test_acc']:.4f}  "
                f"lr {r['lr']:.3g}  {r['samples_per_s']:.0f} samples/s"
            )

    def on_train_end(self, trainer: Trainer, r: dict[str, Any]) -> None:
        if trainer.is_root and r["event"] == "done" and "steps" in r and trainer.cfg.steps:
            self.log(
                f"done: {r['steps']} steps, test_acc {r['test_acc']:.4f}, "
                f"{r['total_seconds']:.1f} s training, {r['params']:,} parameters"
            )
        elif trainer.is_root and r["event"] == "done":
            self.log(
                f"done: {r['epochs']} epochs, test_acc {r['test_acc']:.4f}, "
                f"{r['total_seconds']:.1f} s training, {r['params']:,} parameters"
            )


class ProgressBar(Callback):
    """tqdm's bar over an epoch's steps, on rank 0's terminal."""

    bar: Any = None

    def on_epoch_begin(self, trainer: Trainer, epoch: int) -> None:
        from tqdm import tqdm

        total = trainer.steps_per_epoch
        self.bar = tqdm(total=total, desc=f"epoch {epoch + 1}", leave=False, unit="batch")

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if self.bar is None:  # training by steps: one bar over the run's steps
            from tqdm import tqdm

            self.bar = tqdm(total=trainer.cfg.steps, desc="steps", leave=False, unit="batch")
        self.bar.update()

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        self.bar.close()
        self.bar = None

    def on_train_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class Checkpoints(Callback):
    """After every epoch, rank 0 writes the whole network and optimizer state (gathered)."""

    def __init__(self, directory: str, keep: int = KEEP_CHECKPOINTS) -> None:
        self.directory, self.keep = directory, keep

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if not all(math.isfinite(record[k]) for k in ("train_loss", "test_loss")):
            return  # a diverged epoch is never checkpointed
        model, optimizer, comm = trainer.model, trainer.optimizer, trainer.model_comm
        if trainer.data_comm.rank != 0 or not (trainer.is_root or is_spread(model)):
            return
        stall.in_phase(f"the checkpoint of epoch {record['epoch']}")
        params = whole_params(model, comm)
        state = {
            name: whole_arrays(model, comm, model.named_views(buf))
            for name, buf in optimizer.state.items()
        }
        if trainer.is_root:
            with path_problems("checkpoint_dir", self.directory):
                save_checkpoint(
                    self.directory,
                    params,
                    state,
                    record["epoch"],
                    optimizer.step_count,
                    trainer.cfg.seed,
                    trainer.data.name,
                    trainer.settings(),
                    trainer.identity(),
                    trainer.loss_scale.state() if trainer.loss_scale else None,
                )
                prune_checkpoints(self.directory, self.keep)  # only once the new one is whole


class FaultInjection(Callback):
    """``XPNN_FAIL_AT=RANK:STEP`` makes that rank raise at that step (for the fault tests)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_step_begin(self, trainer: Trainer, step: int) -> None:
        if (trainer.comm.rank, step) == (self.rank, self.step):
            raise RuntimeError(f"injected failure at step {step} (XPNN_FAIL_AT)")

    @classmethod
    def from_env(cls) -> FaultInjection | None:
        spec = os.environ.get("XPNN_FAIL_AT")
        if not spec:
            return None
        rank, _, step = spec.partition(":")
        if not (rank.strip().isdigit() and step.strip().isdigit()):
            raise UserError(f"XPNN_FAIL_AT={spec}: expected RANK:STEP, e.g. 1:3")
        return cls(int(rank), int(step))


class PhaseTimer(Callback):
    """Seconds of every step and its phases (``xpnn.phases``), a dict per step in ``steps``; on
    a GPU each is synchronized at both ends, or it would time kernel launches."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.trainer: Trainer | None = None
        self._current: dict[str, float] | None = None
        self._open: dict[str, tuple[int, float]] = {}  # phase -> (depth, start)
        self._sync: Any = None
        self._t0 = 0.0

    def on_train_begin(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self._sync = trainer.backend.synchronize if trainer.backend.is_gpu else None
        phases.listen(self._mark)

    def on_train_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        phases.listen(None)

    def on_step_begin(self, trainer: Trainer, step: int) -> None:
        self._current = dict.fromkeys(phases.PHASES, 0.0)
        if self._sync:
            self._sync()
        self._t0 = time.perf_counter()

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if self._sync:
            self._sync()
        assert self._current is not None
        self._current["step"] = time.perf_counter() - self._t0
        self.steps.append(self._current)
        self._current = None

    def _mark(self, name: str, entering: bool) -> None:
        if self._current is None:  # outside a step: evaluation
            return
        depth, start = self._open.get(name, (0, 0.0))
        if entering:
            if depth == 0:
                if self._sync:
                    self._sync()
                start = time.perf_counter()
            self._open[name] = (depth + 1, start)
            return
        if depth == 1:
            if self._sync:
                self._sync()
            self._current[name] += time.perf_counter() - start
        self._open[name] = (depth - 1, start)
