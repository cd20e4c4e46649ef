"""User-facing errors.

A ``UserError`` is a mistake the user can fix (a bad flag, a missing or corrupt file). The CLI
prints its message as one line on stderr and exits 2; anything else is a bug and exits 1.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class UserError(Exception):
    """A problem with the user's input: one line naming the file or flag and what is wrong."""

    exit_code = 2


@contextmanager
def path_problems(flag: str, path: object) -> Iterator[None]:
    """Checks of a path the user gave, or writes to it, where the file system may refuse: a
    path under a directory this user may not enter makes even ``Path.exists()`` raise
    ``PermissionError``, and a full disk fails a save at the end of a run. Those are the
    user's to fix, so they become a ``UserError`` naming the flag and the path (and the path
    refused, when it is another one)."""
    try:
        yield
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
        reason = exc.strerror or type(exc).__name__
        raise UserError(f"{flag} {path}: {reason}{where}") from None
