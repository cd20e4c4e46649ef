"""User-facing errors.

A ``UserError`` is a mistake the user can fix (a bad setting, a missing or corrupt file). The
library names settings by their parameter names, in backticks (`` `batch_size` ``); the command
line words each as its flag (``--batch-size``) when it prints the one line, and exits 2.
Anything else is a bug and exits 1.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PARAM = re.compile(r"(?<!`)`([a-z][a-z0-9_]*)`(?!`)")  # a parameter's name as messages write it


class UserError(Exception):
    """A problem with the user's input: one line naming the file or parameter and what is
    wrong. ``param`` is the parameter it is about (default: the first one the message names)."""

    exit_code = 2

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        found = PARAM.search(message)
        self.param = param or (found[1] if found else None)


_wordings: list[Callable[[str], str]] = []


@contextmanager
def worded(wording: Callable[[str], str]) -> Iterator[None]:
    """Within this block, ``user_message`` passes every message through ``wording``: how the
    command line names its flags where the library names parameters."""
    _wordings.append(wording)
    try:
        yield
    finally:
        _wordings.remove(wording)


def user_message(text: object) -> str:
    """``text`` (a message, or an exception) as the user is shown it."""
    text = str(text)
    for wording in _wordings:
        text = wording(text)
    return text


@contextmanager
def path_problems(param: str, path: object) -> Iterator[None]:
    """Checks of a path the user gave, or writes to it, where the file system may refuse: a
    path under a directory this user may not enter makes even ``Path.exists()`` raise
    ``PermissionError``, and a full disk fails a save at the end of a run. Those are the
    user's to fix, so they become a ``UserError`` naming the parameter and the path (and the
    path refused, when it is another one)."""
    try:
        yield
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
        reason = exc.strerror or type(exc).__name__
        raise UserError(f"`{param}` {path}: {reason}{where}", param) from None
