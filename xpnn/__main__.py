"""``python -m xpnn`` and the ``xpnn`` command: see xpnn.cli.

The early interrupt handler goes in before anything else is imported: a Ctrl-C from the first
instant that xpnn's code runs is one line and exit 130 (xpnn.interrupts).
"""

from xpnn.interrupts import catch_early_interrupts


def run() -> int:
    """The command line, with Ctrl-C handled from its first instant."""
    catch_early_interrupts()
    from xpnn.cli import main

    return main()


if __name__ == "__main__":
    raise SystemExit(run())
