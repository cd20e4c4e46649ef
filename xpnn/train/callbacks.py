"""The callbacks a run is made of besides its loop, on every rank (a writer checks ``is_root``)."""

import math
import os
import signal
import sys
import time
from typing import Any

import numpy as np

from xpnn.errors import UserError, path_problems
from xpnn.parallel.model.whole import is_spread, whole_arrays, whole_params
from xpnn.record import phases
from xpnn.record.files import open_to_write
from xpnn.runtime import stall
from xpnn.runtime.failure import CollectiveExit
from xpnn.runtime.interrupts import STATE
from xpnn.runtime.threads import describe_threads
from xpnn.train import metrics_file
from xpnn.train.checkpoint import KEEP_CHECKPOINTS, atomic_savez, prune_checkpoints, save_checkpoint
from xpnn.train.midepoch import partial_of
from xpnn.train.trainer import Callback, Trainer, finite


class MetricsFile(Callback):
    """The JSON-lines metrics file (rank 0), emptied by a fresh run; not finite is null."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.finished = False  # a resume of a run already done: its "done" record is there

    def on_train_begin(self, trainer: Trainer) -> None:
        if not trainer.is_root:
            return
        with path_problems("metrics", self.path):
            metrics_file.check_metrics_file(self.path)  # never empty another file
            if trainer.optimizer.step_count == 0:  # a fresh run, a fresh file
                os.close(open_to_write(self.path, os.O_CREAT | os.O_TRUNC))  # no other's link
            else:  # each epoch once: what came after the resumed checkpoint goes
                cfg = trainer.cfg
                steps = trainer.optimizer.step_count if cfg.steps else None
                metrics_file.keep_until(self.path, trainer.start_epoch, steps)
                left = steps < cfg.steps if steps else trainer.start_epoch < cfg.epochs
                self.finished = not left and metrics_file.last_event(self.path) == "done"

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if not trainer.is_root:
            return
        line = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in record.items()}  # fmt: skip
        with path_problems("metrics", self.path):
            metrics_file.append_record(self.path, line)

    def on_train_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """The run's last line, written as an epoch's; once, however often it is resumed."""
        if not self.finished:
            self.on_epoch_end(trainer, record)

    on_eval = on_epoch_end


class EpochLog(Callback):
    """A line per record and one at the end, printed by rank 0 through ``log``."""

    def __init__(self, log: Any) -> None:
        self.log = log

    def on_epoch_end(self, trainer: Trainer, r: dict[str, Any]) -> None:
        if not trainer.is_root:
            return
        scores = f"train_loss {r['train_loss']:.4f}  test_loss {r['test_loss']:.4f}  "
        scores += f"test_acc {r['test_acc']:.4f}"
        rate = f"{r['samples_per_s']:.0f} samples/s"
        if r["event"] == "eval":
            self.log(f"step {r['step']}/{trainer.cfg.steps}  {scores}  lr {r['lr']:.3g}  {rate}")
            return
        line = f"epoch {r['epoch']}/{trainer.cfg.epochs}  {scores}  {r['seconds']:.1f} s  {rate}"
        if r["epoch"] == trainer.start_epoch + 1:
            line += f"  [{r['backend']}, comm {r['comm']}, {r['world_size']} rank(s)"
            line += (f" x {describe_threads(r)}" if "threads" in r else "") + "]"
        self.log(line)

    on_eval = on_epoch_end

    def on_train_end(self, trainer: Trainer, r: dict[str, Any]) -> None:
        if trainer.is_root and r["event"] == "done":
            made = f"{r['steps']} steps" if trainer.cfg.steps else f"{r['epochs']} epochs"
            took = f"{r['total_seconds']:.1f} s training, {r['params']:,} parameters"
            self.log(f"done: {made}, test_acc {r['test_acc']:.4f}, {took}")


class ProgressBar(Callback):
    """tqdm's bar over an epoch's steps (by ``steps``: the run's), on rank 0's terminal."""

    bar: Any = None

    def _open(self, total: int, desc: str) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc=desc, leave=False, unit="batch")

    def on_epoch_begin(self, trainer: Trainer, epoch: int) -> None:
        self._open(trainer.steps_per_epoch, f"epoch {epoch + 1}")

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if self.bar is None:
            self._open(trainer.cfg.steps, "steps")
        self.bar.update()

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.bar is not None:  # by ``steps``: open until the run ends
            self.bar.close()
        self.bar = None

    on_train_end = on_epoch_end


def write_checkpoint(
    trainer: Any, directory: str, keep: int, epoch: int, partial: dict | None = None
) -> None:
    """The whole network and optimizer state, gathered (collective), written by rank 0."""
    model, optimizer, comm = trainer.model, trainer.optimizer, trainer.model_comm
    states = trainer.update.whole_state()  # every data-parallel rank: a sharded one gathers
    if trainer.data_comm.rank != 0 or not (trainer.is_root or is_spread(model)):
        return
    stall.in_phase(f"the checkpoint at step {optimizer.step_count}")
    params = whole_params(model, comm)
    state = {n: whole_arrays(model, comm, model.named_views(b)) for n, b in states.items()}
    if trainer.is_root:
        scale = trainer.loss_scale.state() if trainer.loss_scale else None
        said = dict(settings=trainer.settings(), identity=trainer.identity(), loss_scale=scale)
        step, seed = optimizer.step_count, trainer.cfg.seed
        with path_problems("checkpoint_dir", directory):
            args = (directory, params, state, epoch, step, seed, trainer.data.name)
            save_checkpoint(*args, **said, partial=partial)
            prune_checkpoints(directory, keep)  # only once the new one is whole


class Checkpoints(Callback):
    """After every record rank 0 writes the whole network and optimizer state (gathered)."""

    def __init__(self, directory: str, keep: int = KEEP_CHECKPOINTS) -> None:
        self.directory, self.keep = directory, keep

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if finite(record):
            write_checkpoint(trainer, self.directory, self.keep, record["epoch"])

    def on_eval(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if finite(record):
            partial = partial_of("steps", [], 0.0, [0.0, 0.0])  # the next span starts afresh
            epochs = record["step"] // trainer.steps_per_epoch
            write_checkpoint(trainer, self.directory, self.keep, epochs, partial)


class SaveParameters(Callback):
    """At the end of a run rank 0 writes the whole network's parameters by name (``.npz``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if record["event"] == "done" and trainer.is_root:
            with path_problems("save", self.path):  # a full disk, say
                atomic_savez(self.path, trainer.final_params)


def run_callbacks(
    log: Any,
    is_root: bool,
    *,
    metrics: str | None = None,
    save: str | None = None,
    checkpoint_dir: str | None = None,
    keep_checkpoints: int = KEEP_CHECKPOINTS,
    progress: bool = False,
) -> list[Callback]:
    """A run's own, in acting order: parameters saved before the done line, checkpoints early."""
    own = [
        SaveParameters(save) if save else None,
        FaultInjection.from_env(),
        PauseInjection.from_env(),
        ProgressBar() if progress and is_root and sys.stderr.isatty() else None,
        MetricsFile(metrics) if metrics else None,
        EpochLog(log),
        Checkpoints(checkpoint_dir, keep_checkpoints) if checkpoint_dir else None,
    ]
    return [c for c in own if c is not None]


class FaultInjection(Callback):
    """``XPNN_FAIL_AT=RANK:STEP`` makes that rank raise at that step (for the fault tests)."""

    VARIABLE, FORM, EXAMPLE, KINDS = "XPNN_FAIL_AT", "RANK:STEP", "1:3", (int, int)

    def __init__(self, rank: int, step: int, seconds: float = 0.0) -> None:
        self.rank, self.step, self.seconds = rank, step, seconds

    def on_step_begin(self, trainer: Trainer, step: int) -> None:
        if (trainer.comm.rank, step) == (self.rank, self.step):
            self.act(step)

    def act(self, step: int) -> None:
        raise RuntimeError(f"injected failure at step {step} (XPNN_FAIL_AT)")

    @classmethod
    def from_env(cls) -> "FaultInjection | None":
        if not (spec := os.environ.get(cls.VARIABLE)):
            return None
        try:
            return cls(*(kind(part) for kind, part in zip(cls.KINDS, spec.split(":"), strict=True)))
        except ValueError:
            why = f"{cls.VARIABLE}={spec}: expected {cls.FORM}, e.g. {cls.EXAMPLE}"
            raise UserError(why) from None


class PauseInjection(FaultInjection):
    """``XPNN_SLEEP_AT=RANK:STEP:SECONDS`` (the stall tests): that rank sleeps before that step."""

    VARIABLE, FORM, EXAMPLE = "XPNN_SLEEP_AT", "RANK:STEP:SECONDS", "1:3:5"
    KINDS = (int, int, float)

    def act(self, step: int) -> None:
        time.sleep(self.seconds)


class PhaseTimer(Callback):
    """Seconds of each step and its phases (synchronized on a GPU, else it times launches)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.trainer: Trainer | None = None  # the trainer that ran, once training began
        self._current: dict[str, float] | None = None
        self._open: dict[str, float] = {}  # phase -> its start

    def on_train_begin(self, trainer: Trainer) -> None:
        self.trainer, backend = trainer, trainer.backend
        self._sync = backend.synchronize if backend.is_gpu else lambda: None
        phases.listen(self._mark)

    def on_train_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        phases.listen(None)

    def on_step_begin(self, trainer: Trainer, step: int) -> None:
        self._current = dict.fromkeys(phases.PHASES, 0.0)
        self._sync()
        self._t0 = time.perf_counter()

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        self._sync()
        self._current["step"] = time.perf_counter() - self._t0
        self.steps.append(self._current)
        self._current = None

    def _mark(self, name: str, entering: bool) -> None:
        if self._current is None:  # outside a step: evaluation
            return
        self._sync()
        if entering:
            self._open[name] = time.perf_counter()
        elif name in self._open:
            self._current[name] += time.perf_counter() - self._open.pop(name)


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
