"""``python -m xpnn [train|info|plot|generate]``: the flags (``xpnn.flags``) fill a ``RunSpec`` that
``xpnn.run`` runs, and the exit codes: 0 success; 2 a user error, one line naming the flag or
file, printed once for all ranks; 1 anything else."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Sequence
from typing import Any

from xpnn.errors import UserError, user_message, worded
from xpnn.flags import (
    ArgError,
    build_info_parser,
    build_parser,
    flag_words,
    to_spec,
    typed_settings,
)
from xpnn.generate import main as generate_main
from xpnn.info import info_main
from xpnn.interrupts import hand_over
from xpnn.plot import main as plot_main
from xpnn.run import launch
from xpnn.runtime import failure
from xpnn.runtime.world import launch_rank

__all__ = ["main"]


def _say(line: str, err: bool = False) -> None:
    print(flag_words(line), file=sys.stderr if err else sys.stdout, flush=True)


def train_main(
    args: argparse.Namespace, callbacks: Sequence[Any] = (), given: frozenset[str] | None = None
) -> int:
    """``given``: the settings typed on the command line, which a model's preset leaves alone."""
    warn = functools.partial(_say, err=True)
    return launch(to_spec(args), callbacks, log=_say, warn=warn, given=given)


def _info(as_json: bool) -> int:
    """``python -m xpnn info``; stdout gone or full is one line, as training says it."""
    try:
        return info_main(as_json=as_json)
    except OSError as exc:
        message, code = failure.stopped_from_outside(exc) or (failure.describe(exc), 1)
        failure.say(f"xpnn: {message}")
        return code


def main(argv: list[str] | None = None, callbacks: Sequence[Any] = ()) -> int:
    """``python -m xpnn``; ``callbacks`` (``xpnn.train.Callback``) join the trainer's."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plot":
        return plot_main(argv[1:])
    if argv and argv[0] == "generate":
        return generate_main(argv[1:])
    command = argv.pop(0) if argv and argv[0] in ("train", "info") else "train"
    parser = build_info_parser() if command == "info" else build_parser()
    try:
        args = parser.parse_args(argv)
        given = typed_settings(parser, argv) if command == "train" else None
    except ArgError as exc:
        if launch_rank() == 0:
            print(f"xpnn: {exc}", file=sys.stderr)
        return 2
    with worded(flag_words):  # every message printed from here names flags
        try:
            if command == "info":
                hand_over(failure.Terminated)  # no run_guarded: Ctrl-C is for the except below
                return _info(args.json)
            return train_main(args, callbacks, given)
        except UserError as exc:  # before MPI: every process found the same, one says it
            if launch_rank() == 0:
                print(f"xpnn: {user_message(exc)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as exc:  # while NumPy or MPI start, without xpnn.__main__
            message, code = failure.stopped_from_outside(exc) or ("interrupted", 130)
            if launch_rank() == 0:
                failure.say(f"xpnn: {message}")
            return code
