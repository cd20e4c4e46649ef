"""Each rank's ``trace-rank{N}.json`` of a window of steps: Chrome trace events, for Perfetto."""

import importlib
import json
import os
import time
from typing import Any

from xpnn.errors import UserError, path_problems
from xpnn.record import phases
from xpnn.record.files import replace_whole
from xpnn.record.timeline import lane_meta, parse_steps, span_event
from xpnn.runtime import flight
from xpnn.train.callbacks import Callback
from xpnn.train.trainer import Trainer

DEFAULT_START, DEFAULT_STEPS = 3, 5  # a few steps after the first ones (allocation, JIT)
CLOCK_ROUNDS = 9  # barriers whose exit times estimate each rank's clock offset to rank 0
LANES = {
    phases.COMPUTE: "compute",
    phases.COPIES: "host<->device copies",
    phases.DEVICE: "device (CUDA events)",
}
_now = time.perf_counter


def default_window(total_steps: int) -> tuple[int, int]:
    """``DEFAULT_STEPS`` steps from ``DEFAULT_START``, moved earlier in a short run."""
    start = max(0, min(DEFAULT_START, total_steps - DEFAULT_STEPS))
    return start, max(start + 1, min(total_steps, start + DEFAULT_STEPS))


class _CudaEvents:
    """CUDA events on the current stream of PyTorch (CUDA or ROCm) or CuPy."""

    def __init__(self, torch: bool) -> None:
        self.torch, self._cuda = torch, importlib.import_module("torch" if torch else "cupy").cuda

    def mark(self) -> Any:
        event = self._cuda.Event(enable_timing=True) if self.torch else self._cuda.Event()
        event.record()
        return event

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) if self.torch else self._cuda.get_elapsed_time(start, end)


def device_events(backend: Any) -> _CudaEvents | None:
    """The CUDA events that time ``backend``'s device work (None: the CPU, MPS, XPU)."""
    if not backend.is_gpu:
        return None
    torch = backend.array_library == "torch"
    return None if torch and backend.torch_device.type != "cuda" else _CudaEvents(torch)


class _Span:
    __slots__ = ("trace", "name", "lane", "start", "device")

    def __init__(self, trace: "Trace", name: str, lane: int) -> None:
        self.trace, self.name, self.lane = trace, name, lane

    def __enter__(self) -> None:
        self.device = self.trace.device_mark()
        self.start = _now()

    def __exit__(self, *exc: Any) -> None:
        self.trace.add(self.name, "span", self.lane, self.start, _now())
        if self.device is not None:
            self.trace.device.append((self.name, self.device, self.trace.device_mark()))


class Trace(Callback):
    """Writes ``directory/trace-rank{N}.json`` on every rank for steps A to B-1 of ``steps``."""

    def __init__(self, directory: str, steps: tuple[int, int] | None = None) -> None:
        self.directory, self.steps = directory, steps
        self.events: list[tuple] = []  # (name, cat, lane, start s, end s, args)
        self.active = False
        self.written: str | None = None
        self._open: dict[str, float] = {}  # phase -> its start
        self._slots: list[float] = []  # the end of the last operation on each comm lane
        self.device: list[tuple[str, Any, Any]] = []  # a span's device events: (name, start, end)
        self._events: _CudaEvents | None = None  # a span outside a run (bench trace_cost) has none

    def on_train_begin(self, trainer: Trainer) -> None:
        self.rank, self.steps_per_epoch = trainer.comm.rank, trainer.steps_per_epoch
        self.window = self.steps or default_window(trainer.total_steps)
        clock = []  # this rank's clock entering and leaving the same barriers as the others
        for _ in range(CLOCK_ROUNDS):
            entered = _now()
            trainer.comm.barrier()
            clock.append([entered * 1e6, _now() * 1e6])
        model = trainer.model
        self.info = {
            "rank": self.rank,
            "ranks": trainer.comm.size,
            "parallel": trainer.cfg.parallel,
            "backend": trainer.backend.name,
            "comm": trainer.data_comm.name,
            "stage": getattr(model, "index", None),
            **{k: getattr(model, k, None) for k in ("stages", "microbatches", "schedule")},
            "window": list(self.window),
            "clock": clock,
            "clock_unit": "us, time.perf_counter, entering and leaving each of the same barriers",
        }
        self._events, self._sync = device_events(trainer.backend), trainer.backend.synchronize

    def on_step_begin(self, trainer: Trainer, step: int) -> None:
        if step == self.window[0] and not self.active:
            self.active, self._previous = True, phases.listening()
            phases.listen(self._phase)
            phases.trace_to(self)
            if self._events is not None:  # device times are measured from this event on
                self._sync()
                self._device_origin = (self.device_mark(), _now())
        if self.active:
            self._step_start = _now()

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        if not self.active:
            return
        self.add(f"step {step}", "step", phases.COMPUTE, self._step_start, _now())
        self._last_step_end = _now()
        if step >= self.window[1] - 1 and (step + 1) % self.steps_per_epoch:  # else at its record
            self._finish()

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if not self.active:
            return
        # the test set's evaluation and the epoch's metrics ran since the last step ended
        self.add("evaluation", "evaluation", phases.COMPUTE, self._last_step_end, _now())
        if record["epoch"] * self.steps_per_epoch >= self.window[1]:
            self._finish()

    def on_train_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.active or self.written is None:
            self._finish()  # a run shorter than the window: what there is

    def span(self, name: str, lane: int) -> _Span:  # the tracer's (``phases.trace_to``)
        return _Span(self, name, lane)

    def operation(self, record: Any) -> None:
        """A finished operation on a communication lane, its wait on the compute lane."""
        name, slots = record.name(), self._slots  # the first lane free at its start, or a new one
        free = next((i for i, end in enumerate(slots) if end <= record.start), len(slots))
        slots[free : free + 1] = [record.end]
        args = {"bytes": record.nbytes, "seq": record.seq, "group": record.group}
        lane = phases.COMMUNICATION + free
        self.add(name, "communication", lane, record.start, record.end, args)
        if record.posted is not None:  # handing it to MPI took the compute lane's time
            self.add(f"post {name}", "post", phases.COMPUTE, record.start, record.posted, args)
        if record.end > record.wait:
            self.add(f"wait {name}", "wait", phases.COMPUTE, record.wait, record.end, args)

    def _phase(self, name: str, entering: bool) -> None:
        if self._previous is not None:
            self._previous(name, entering)
        if entering:
            self._open[name] = _now()
        elif name in self._open:  # (not one entered before it listened)
            self.add(name, "phase", phases.COMPUTE, self._open.pop(name), _now())

    def add(
        self, name: str, cat: str, lane: int, start: float, end: float, args: Any = None
    ) -> None:
        # a tuple, made a dict when written: cheap to add, and no work for the cyclic GC
        self.events.append((name, cat, lane, start, end, args))

    def device_mark(self) -> Any:
        return None if self._events is None else self._events.mark()

    def _finish(self) -> None:
        if self.active:
            phases.trace_to(None)
            phases.listen(self._previous)
            self.active = False
        if self.device:  # device spans, placed on the host clock from the first event on
            self._sync()
            origin, host = self._device_origin
            get = self._events.elapsed_ms  # milliseconds between two recorded events
            for name, start, end in self.device:
                begin = host + get(origin, start) / 1e3
                self.add(name, "device", phases.DEVICE, begin, begin + get(start, end) / 1e3)
            self.device.clear()
        stage = self.info.get("stage")
        label = f"rank {self.rank} (host)" + (f", stage {stage}" if stage is not None else "")
        lanes = [lane_meta("process_name", self.rank, 0, name=label)]
        lanes.append(lane_meta("process_sort_index", self.rank, 0, sort_index=self.rank))
        for tid in sorted({e[2] for e in self.events}):
            lane = LANES.get(tid) or f"communication {tid - phases.COMMUNICATION + 1}"
            lanes.append(lane_meta("thread_name", self.rank, tid, name=lane))
            lanes.append(lane_meta("thread_sort_index", self.rank, tid, sort_index=tid))
        path = os.path.join(self.directory, f"trace-rank{self.rank}.json")
        doc = {
            "traceEvents": lanes + [span_event(self.rank, *e) for e in self.events],
            "displayTimeUnit": "ms",
            "otherData": {"xpnn": self.info},
        }
        with path_problems("trace", self.directory):
            os.makedirs(self.directory, exist_ok=True)
            replace_whole(path, json.dumps(doc).encode())  # never through a planted link
        self.written = path


def observers(spec: Any, rank: int) -> list[Callback]:
    """The ``Trace`` ``spec.trace`` asks for; the flight recorder dumps beside the run's files."""
    if (metrics := spec.metrics) and (os.path.isfile(metrics) or not os.path.exists(metrics)):
        flight.dump_to(os.path.dirname(os.path.abspath(metrics)), rank)
    elif spec.checkpoint_dir or spec.trace:
        flight.dump_to(spec.checkpoint_dir or spec.trace, rank)
    steps = None
    if spec.trace_steps is not None:
        try:
            steps = parse_steps(spec.trace_steps)
        except ValueError as exc:
            raise UserError(f"`trace_steps` {exc}") from None
        if not spec.trace:
            raise UserError("`trace_steps`: needs `trace`")
    if not spec.trace:
        return []
    with path_problems("trace", spec.trace):  # said at the start, not after the traced steps
        os.makedirs(spec.trace, exist_ok=True)
        if not os.access(spec.trace, os.W_OK | os.X_OK):
            raise UserError(f"`trace` {spec.trace}: not a directory this user may write to")
    return [Trace(spec.trace, steps)]
