"""A stand-in for ``Backend.capture`` on the CPU, for the tests of the replayable step: it
runs the function's Python once when "recording" (undoing what it did to the arrays, as a
recording runs none of the work), and at each replay runs it again with the optimizer's host
numbers (rate, step count) poisoned, so a replay that read them instead of the device values
would train differently."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np


def standin(trainer: Any, calls: list[str]) -> Callable[[Callable[[], None]], Callable[[], None]]:
    """A recording that replays by running the function again, with the optimizer's host
    numbers (rate, step count) made useless while it runs: only device values give Adam's
    update its rate and bias corrections, and dropout its keys."""

    def capture(fn: Callable[[], None]) -> Callable[[], None]:
        # As a recording runs the function's Python once (device values it asks for are made
        # then) and none of its work: run it, then undo what it did to the arrays.
        opt = trainer.optimizer
        arrays = [trainer.model.params, trainer.model.grads, *opt.state.values()]
        kept = [a.copy() for a in arrays]
        with np.errstate(all="ignore"):  # the device values are filled after the recording
            fn()
        for array, before in zip(arrays, kept, strict=True):
            array[...] = before
        calls.append("captured")

        def replay() -> None:
            opt = trainer.optimizer
            lr, count = opt.lr, opt.step_count
            opt.lr, opt.step_count = math.nan, -(10**6)
            try:
                fn()
            finally:
                opt.lr, opt.step_count = lr, count
            calls.append("replayed")

        return replay

    return capture
