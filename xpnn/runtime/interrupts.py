"""Ctrl-C and SIGTERM before ``run_guarded``: one line and exit 130 (143), no traceback; a rank
under a launcher notes it until MPI runs. Imports only what Python loads first (not ``signal``)."""

import _signal
import os

_LAUNCHER_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
# end a run as Ctrl-C does, exit 128 + number: Slurm's time limit and scancel (TERM), a closed
# terminal or ssh connection (HUP), Ctrl-\\ (QUIT), a CPU-time limit (XCPU)
CODES = {_signal.SIGINT: ("interrupted", 130)}  # signal -> (what to say, exit code)
for _name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGXCPU"):
    if hasattr(_signal, _name):
        CODES[getattr(_signal, _name)] = (f"terminated ({_name})", 128 + getattr(_signal, _name))
_state: dict = {"installed": False, "pending": None, "requested": set()}


def launcher_rank() -> int | None:
    ranks = (int(os.environ[v]) for v in _LAUNCHER_RANK_VARS if os.environ.get(v, "").isdigit())
    return next(ranks, None)


def _handler(signum: int, _frame: object) -> None:
    if launcher_rank() is None:
        what, code = CODES[signum]
        os.write(2, f"xpnn: {what}\n".encode())
        os._exit(code)
    if _state["pending"] is None:
        _state["pending"] = signum


def catch_early_interrupts() -> None:
    """Handle SIGINT and SIGTERM until ``hand_over``; one the parent left ignored stays so."""
    for signum in CODES:
        if _signal.getsignal(signum) != _signal.SIG_IGN:
            _signal.signal(signum, _handler)
    _state["installed"] = True
    if mark := os.environ.get("XPNN_HANDLER_MARK"):  # for the tests: the handler is in place now
        with open(f"{mark}.{launcher_rank() or 0}", "w") as fh:
            fh.write(str(os.getpid()))  # whom to signal


def catch_early_checkpoint_signal(argv: list[str]) -> None:
    """Note ``--checkpoint-signal`` USR1 or USR2 (``SIGNALS``) early: else they end the rank."""
    name = None
    for i, word in enumerate(argv):
        if word == "--checkpoint-signal" and i + 1 < len(argv):
            name = argv[i + 1]
        elif word.startswith("--checkpoint-signal="):
            name = word.partition("=")[2]
    signum = getattr(_signal, f"SIG{name}", None) if name in ("USR1", "USR2") else None
    if signum is not None and _signal.getsignal(signum) != _signal.SIG_IGN:
        _signal.signal(signum, lambda signum, _frame: _state["requested"].add(signum))


def checkpoint_requested(signum: int) -> bool:
    """Whether ``signum`` arrived while ``catch_early_checkpoint_signal``'s handler held it."""
    return signum in _state["requested"]


def hand_over(terminated: type[BaseException]) -> None:
    """SIGINT raises ``KeyboardInterrupt`` again, SIGTERM ``terminated``; a pending one now."""
    if not _state["installed"]:
        return
    _state["installed"] = False

    def on_stop(signum: int, _frame: object) -> None:
        raise terminated(signum)

    for signum in CODES:
        if _signal.getsignal(signum) is _handler:
            interrupt = signum == _signal.SIGINT
            _signal.signal(signum, _signal.default_int_handler if interrupt else on_stop)
    pending, _state["pending"] = _state["pending"], None
    if pending == _signal.SIGINT:
        raise KeyboardInterrupt
    if pending is not None:
        raise terminated(pending)


def forget_handled_interrupt() -> None:
    """Clear the unhandled-Ctrl-C flag that C imports leave set: Python would end by SIGINT."""
    import ctypes

    ctypes.pythonapi.PyRun_SimpleString(b"pass")


def pending_signal() -> int | None:
    return _state["pending"]
