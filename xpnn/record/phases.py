"""Named phases of a step (``with WGRAD:``) a listener may time; with none, a mark costs a test."""

import threading
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

Listener = Callable[[str, bool], None]  # (phase name, True on entry / False on exit)

_listener: list[Listener | None] = [None]
_quiet = threading.local()  # ``on`` in the threads whose phases nobody hears (``quiet_here``)


def quiet_here() -> None:
    """This thread's phases and spans reach nobody (a batch thread's would tangle the step's)."""
    _quiet.on = True


def _heard() -> bool:
    return not getattr(_quiet, "on", False)


class Phase:
    """A context manager marking one phase; re-entrant: a listener hears the outermost only."""

    __slots__ = ("name", "depth")

    def __init__(self, name: str) -> None:
        self.name, self.depth = name, 0  # the entries heard and not yet left

    def __enter__(self) -> None:
        listener = _listener[0]
        if listener is not None and _heard():
            self.depth += 1
            if self.depth == 1:
                listener(self.name, True)

    def __exit__(self, *exc: Any) -> None:
        # counted down whether or not a listener is still there: one that leaves mid-phase
        # must not leave the count up for the next (which would then never hear this phase)
        if self.depth and _heard():
            self.depth -= 1
            if self.depth == 0 and (listener := _listener[0]) is not None:
                listener(self.name, False)


FORWARD = Phase("forward")  # the model's forward pass
WGRAD = Phase("wgrad")  # the products that write weight gradients
UPDATE = Phase("update")  # the optimizer's update of one part of the parameters
FENCES = Phase("fences")  # node-shared memory fences, the wait for the node's slowest rank
PHASES = tuple(p.name for p in (UPDATE, FENCES, FORWARD, WGRAD))


def listen(listener: Listener | None) -> None:
    _listener[0] = listener


def listening() -> Listener | None:
    """The listener ``listen`` set (a second one chains to it)."""
    return _listener[0]


COMPUTE, COPIES, DEVICE, COMMUNICATION = 1, 2, 3, 10  # a trace's lanes (``tid``); 10, 11...: ops
NOTHING = nullcontext()  # the span when nobody traces
_tracer: list[Any] = [None]


def trace_to(tracer: Any) -> None:  # a ``xpnn.train.trace.Trace``, or None
    _tracer[0] = tracer


def tracer() -> Any:
    return _tracer[0]


def span(name: str, lane: int = COMPUTE) -> Any:
    """``with span("loss"):`` a span on ``lane`` while a tracer listens; else nothing."""
    t = _tracer[0]
    return NOTHING if t is None or not _heard() else t.span(name, lane)


def layer_span(kind: str, index: int, layer: Any) -> Any:
    """A layer's ``forward`` or ``backward``, named lazily: a tracer that is off costs a test."""
    t = _tracer[0]
    if t is None or not _heard():
        return NOTHING
    return t.span(f"{kind} {index} {type(layer).__name__}", COMPUTE)
