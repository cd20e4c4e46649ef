"""Ctrl-C and SIGTERM before the run is guarded: one line and exit 130 (143), not a traceback.

``python -m xpnn`` spends its first tenth of a second or more importing NumPy, mpi4py and
Numba and starting MPI. Python raises ``KeyboardInterrupt`` wherever SIGINT lands: left to
itself, a Ctrl-C there is a traceback from the middle of an import, or, caught by code that
imports in turn, "cannot load module more than once per process" from a half-loaded NumPy;
SIGTERM ends the process without a word. ``catch_early_interrupts()``, called before
anything else is imported, puts a handler in place until ``run_guarded`` takes over
(``hand_over``):

* a process on its own says ``xpnn: interrupted`` and leaves at once (``os._exit``: nothing
  is open yet that needs closing, and no import is left half done to trip over);
* a rank under an MPI launcher must not leave before MPI has started: the others would wait
  for it inside ``MPI_Init`` for ever (hydra does not notice a process that leaves before it
  has joined). It notes the signal and carries on; ``hand_over`` raises it once MPI runs,
  inside ``run_guarded``, where every rank stops together with one line.

This module runs first, so it imports only what Python has loaded before any program runs
(``os``, and ``_signal``, the C half of ``signal``: ``signal`` itself imports ``enum``, time
enough for a Ctrl-C to land in the middle).
"""

from __future__ import annotations

import _signal
import os

_LAUNCHER_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
_CODES = {_signal.SIGINT: (130, "interrupted"), _signal.SIGTERM: (143, "terminated (SIGTERM)")}
_state: dict = {"installed": False, "pending": None}


def _launch_rank() -> int | None:
    """The rank a launcher gave this process, or None without a launcher."""
    for var in _LAUNCHER_RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None


def _handler(signum: int, frame: object) -> None:
    rank = _launch_rank()
    if rank is None:
        code, what = _CODES[signum]
        os.write(2, f"xpnn: {what}\n".encode())
        os._exit(code)
    if _state["pending"] is None:
        _state["pending"] = signum


def catch_early_interrupts() -> None:
    """Handle SIGINT and SIGTERM as the module's docstring says, until ``hand_over``. A
    signal the parent left ignored (a shell's background job) stays ignored."""
    for signum in _CODES:
        if _signal.getsignal(signum) != _signal.SIG_IGN:
            _signal.signal(signum, _handler)
    _state["installed"] = True
    mark = os.environ.get("XPNN_HANDLER_MARK")  # for the tests: the handler is in place now
    if mark:
        open(f"{mark}.{_launch_rank() or 0}", "w").close()


def hand_over(terminated: type[BaseException]) -> None:
    """From here on ``run_guarded`` handles signals: SIGINT raises ``KeyboardInterrupt``
    again, and SIGTERM ``terminated`` where the early handler still holds it. A signal that
    came while MPI started is raised now, so that every rank stops together."""
    if not _state["installed"]:
        return
    _state["installed"] = False

    def on_sigterm(signum: int, frame: object) -> None:
        raise terminated

    if _signal.getsignal(_signal.SIGINT) is _handler:
        _signal.signal(_signal.SIGINT, _signal.default_int_handler)
    if _signal.getsignal(_signal.SIGTERM) is _handler:
        _signal.signal(_signal.SIGTERM, on_sigterm)
    pending, _state["pending"] = _state["pending"], None
    if pending == _signal.SIGINT:
        raise KeyboardInterrupt
    if pending == _signal.SIGTERM:
        raise terminated
