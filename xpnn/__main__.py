"""``python -m xpnn`` (xpnn.commands.cli), with Ctrl-C handled before any import."""

import sys

from xpnn.runtime import interrupts


def run() -> int:
    interrupts.catch_early_checkpoint_signal(sys.argv[1:])  # first: XPNN_HANDLER_MARK marks both in
    interrupts.catch_early_interrupts()
    from xpnn.runtime import threads  # after the handler: a Ctrl-C in its imports is handled

    threads.set_handoff()  # before NumPy and Numba load: they read it once
    try:
        from xpnn.commands.cli import main
    except Exception as exc:  # noqa: BLE001 - a broken import, maybe on one rank: say it
        from xpnn.runtime.failure import failed_import

        return failed_import(exc, "info" if sys.argv[1:2] == ["info"] else "train")

    code = main()
    if code in (130, 143, 129, 131, 152):  # stopped by a signal, said and handled
        interrupts.forget_handled_interrupt()
    return code


if __name__ == "__main__":
    raise SystemExit(run())
