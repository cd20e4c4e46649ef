"""The step replayed as a CUDA graph (``cuda_graph``): inputs, numbers, exchange on the host."""

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from xpnn.backends.common import CaptureFailed, StepScalars
from xpnn.data import shard
from xpnn.errors import UserError
from xpnn.nn.layer import Context
from xpnn.record.phases import listening, tracer

CUDA_GRAPH = ("auto", "on", "off")
Capture = Callable[[Callable[[], None]], Callable[[], None]]


def graph_unavailable(trainer: Any) -> str | None:
    """Why this trainer's step cannot be replayed as a graph (None: it can)."""
    cfg, update = trainer.cfg, trainer.update.name
    scaled = "its loss scale decides on the host whether a step is applied"
    shares = f"the `{update}` update shares host memory between ranks"
    refusals = [  # the first that applies, after the backend's own
        (cfg.plan.spread, f"`parallel` {cfg.plan.mode} exchanges activations inside the step"),
        (cfg.accumulate > 1, "`accumulate` above 1 sums micro-steps of different sizes"),
        (cfg.precision != "fp32", f"`precision` {cfg.precision}: graphs record fp32 steps only"),
        (trainer.loss_scale is not None, f"`grad_dtype` {cfg.grad_dtype}: {scaled}"),  # float16
        (update not in ("local", "allreduce"), shares),
    ]
    found = trainer.backend.capture_unavailable()
    return found if found is not None else next((why for refused, why in refusals if refused), None)


def graph_step(trainer: Any) -> "GraphStep | None":
    """The replayed step for ``cuda_graph``: ``auto`` where it applies, ``on`` or refused."""
    if trainer.cfg.cuda_graph == "off":
        return None
    if (reason := graph_unavailable(trainer)) is None:
        return GraphStep(trainer, trainer.backend.capture)
    if trainer.cfg.cuda_graph == "on":
        raise UserError(f"`cuda_graph` on: {reason}")
    return None


class Recorder:
    """A step's ``fns``: run eagerly by the first step, recorded by the second, replayed after."""

    def __init__(
        self, capture: Capture, optimizer: Any, scalars: StepScalars, fns: list[Callable[[], None]]
    ) -> None:
        self.capture, self.optimizer, self.scalars = capture, optimizer, scalars
        numbers = optimizer.step_scalars  # a replay takes no number: ``scalars`` refreshes them
        self.device_scalars = {
            name: scalars.add(optimizer.params.dtype, lambda _step, name=name: numbers()[name])
            for name in optimizer.scalar_names
        }
        self.fns = [functools.partial(self._replayable, fn) for fn in fns]
        self.replays: list[Callable[[], None]] | None = None
        self.rehearsed = False

    def begin(self, step: int) -> list[Callable[[], None]]:
        """The host's side of ``step``; the functions to call (``CaptureFailed``: none ran)."""
        if self.rehearsed and self.replays is None:
            self.replays = [self.capture(fn) for fn in self.fns]
        self.optimizer.advance()  # clipping, if any, is the recorded functions' (on device)
        self.scalars.refresh(step)
        runs = self.replays or self.fns
        if self.replays is not None and self.optimizer.clip is not None:
            self.optimizer.grad_norm = self.norm  # the recorded norm, as the replay writes it
        self.rehearsed = True
        return runs

    def _replayable(self, fn: Callable[[], None]) -> None:  # ``fn`` on the device's numbers
        opt = self.optimizer
        opt.device_scalars = self.device_scalars
        try:
            fn()
        finally:
            opt.device_scalars = None
        if opt.clip is not None:
            self.norm = opt.grad_norm  # the device value the recording writes


class GraphStep:
    """``Trainer.step`` replayed from a recording of the first full batch's shape."""

    def __init__(self, trainer: Any, capture: Capture) -> None:
        self.trainer, self.capture = trainer, capture
        self.scalars = StepScalars(trainer.backend)
        self.exchange = trainer.data_comm.size > 1  # the exchange between replicas, outside
        self.shape: tuple[int, int] | None = None  # (global batch, this rank's rows) recorded
        self.recorder: Recorder | None = None
        self.failed = False  # a recording failed: every step runs eagerly
        self.replayed = 0  # steps run from the recording
        self._said: set[str] = set()

    def run(self, batch: np.ndarray, step: int) -> tuple[Any, Any] | None:
        """One step on the global ``batch`` from the recording; None: run it eagerly."""
        t = self.trainer
        local = shard(batch, t.data_comm.rank, t.data_comm.size)
        shape = (len(batch), len(local))
        if self._eager(shape):
            return None
        if self.recorder is None:  # the step's inputs and results: buffers the recording reads
            xp, n = t.xp, len(local)
            self.idx = xp.zeros((n,), dtype=xp.int64)
            self.rows = xp.zeros((n,), dtype=xp.int64) if t.data.train_repeats > 1 else self.idx
            text = t.stream is not None  # ``at``: the windows' starts
            self.at = xp.zeros((n, t.data.windows.block), dtype=xp.int64) if text else None
            self.loss, self.correct = xp.zeros((), dtype=xp.float64), xp.zeros((), dtype=xp.float64)
            self.shape = shape
            self.recorder = Recorder(self.capture, t.optimizer, self.scalars, self._fns(shape))
        t.update.begin_step(len(batch))
        self.idx[...] = t.backend.asarray(local, dtype=t.xp.int64)  # this step's, staged
        stored = t.data.stored_rows(local)
        if self.rows is not self.idx:
            self.rows[...] = t.backend.asarray(stored, dtype=t.xp.int64)
        if t.stream is not None:
            spans = t.data.windows.spans(t.cfg.seed, step, stored)
            self.at[...] = t.backend.asarray(spans, dtype=t.xp.int64)
        try:
            runs = self.recorder.begin(step)
        except CaptureFailed as exc:  # nothing of this step ran: it runs eagerly
            self.failed = True
            self._say("failed", f"cuda graph: recording the step failed ({exc}); eager")
            return None
        runs[0]()
        if self.exchange:
            t.update.buckets.wait(len(t.update.buckets.bounds))  # every bucket, in order
            t.update.buckets.finish()
            runs[1]()
        t.optimizer.end_step()
        self.replayed += runs is self.recorder.replays
        return self.loss, self.correct

    def _eager(self, shape: tuple[int, int]) -> bool:
        if self.failed:
            return True
        if tracer() is not None or listening() is not None:  # their marks time host calls
            return self._say("traced", "cuda graph: traced or phase-timed steps run eagerly")
        if shape[1] == 0:
            return self._say("empty", "cuda graph: a rank without samples runs its steps eagerly")
        if self.shape is not None and shape != self.shape:
            why = f"a batch of {shape[0]} samples, not the {self.shape[0]} recorded"
            return self._say("shape", f"cuda graph: {why}: such steps run eagerly")
        return False

    def _say(self, kind: str, line: str) -> bool:  # ``line`` once per ``kind``; True: eagerly
        if kind not in self._said and self.trainer.is_root:
            self.trainer.log(line)
        self._said.add(kind)
        return True

    def _fns(self, shape: tuple[int, int]) -> list[Callable[[], None]]:
        """Forward to update as one function; with replicas two, the exchange between them."""
        t, scale = self.trainer, 1.0 / shape[0]
        ready = None if self.exchange else t.update.grads_ready

        def forward_backward() -> None:
            xb, yb = t.inputs(self.rows, self.at)
            ctx = Context(train=True, step=self.scalars.step, seed=t.cfg.seed, sample_ids=self.idx)
            self.loss[...], self.correct[...] = t.model.loss_and_grads(xb, yb, ctx, scale, ready)
            if not self.exchange:
                t.update.finish()  # what backward left of the update

        def update() -> None:
            t.optimizer.start_step()  # after the exchange: clipping reads the whole gradient
            for index in range(len(t.optimizer.parts)):
                t.optimizer.update_part(index)  # ``end_step``: the host's, after the replay

        return [forward_backward, update] if self.exchange else [forward_backward]
