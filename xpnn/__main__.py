"""``python -m xpnn`` (xpnn.cli), with xpnn.interrupts' handler in before any import."""

from xpnn.interrupts import catch_early_interrupts, forget_handled_interrupt


def run() -> int:
    """The command line, with Ctrl-C handled from its first instant."""
    catch_early_interrupts()
    from xpnn.cli import main

    code = main()
    if code in (130, 143, 129, 131, 152):  # stopped by a signal, said and handled
        forget_handled_interrupt()
    return code


if __name__ == "__main__":
    raise SystemExit(run())
