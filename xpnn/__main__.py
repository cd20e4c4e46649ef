"""``python -m xpnn`` (xpnn.cli), with xpnn.interrupts' handler in before any import."""

from xpnn.interrupts import catch_early_interrupts


def run() -> int:
    """The command line, with Ctrl-C handled from its first instant."""
    catch_early_interrupts()
    from xpnn.cli import main

    return main()


if __name__ == "__main__":
    raise SystemExit(run())
