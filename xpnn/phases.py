"""Named phases of a training step (``with WGRAD: ...``) that a listener (``PhaseTimer``) may
time; with none a mark costs two method calls and a test."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Listener = Callable[[str, bool], None]  # (phase name, True on entry / False on exit)

_listener: list[Listener | None] = [None]


class Phase:
    """A context manager marking one phase; re-entrant, nesting is the listener's to handle."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        listener = _listener[0]
        if listener is not None:
            listener(self.name, True)

    def __exit__(self, *exc: Any) -> None:
        listener = _listener[0]
        if listener is not None:
            listener(self.name, False)


FORWARD = Phase("forward")  # the model's forward pass
WGRAD = Phase("wgrad")  # the products that write weight gradients
UPDATE = Phase("update")  # the optimizer's update of one part of the parameters
FENCES = Phase("fences")  # node-shared memory fences, the wait for the node's slowest rank
PHASES = tuple(p.name for p in (UPDATE, FENCES, FORWARD, WGRAD))


def listen(listener: Listener | None) -> None:
    """Send every phase's start and end to ``listener`` (None: to nobody)."""
    _listener[0] = listener
