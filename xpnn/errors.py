"""User errors, which name settings in backticks (`` `batch_size` ``): the CLI says flags."""

import functools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager

PARAM = re.compile(r"(?<!`)`([a-z][a-z0-9_]*)`(?!`)")  # a parameter's name as messages write it


class UserError(Exception):
    """A mistake the user can fix (exit 2); ``param`` defaults to the first the message names."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param or (found[1] if (found := PARAM.search(message)) else None)


_wordings: list[Callable[[str], str]] = []


@contextmanager
def worded(wording: Callable[[str], str]) -> Iterator[None]:
    """Within this block, ``user_message`` passes every message through ``wording``."""
    _wordings.append(wording)
    try:
        yield
    finally:
        _wordings.remove(wording)


def user_message(text: object) -> str:
    return functools.reduce(lambda said, wording: wording(said), _wordings, str(text))


@contextmanager
def path_problems(param: str, path: object, doing: str = "") -> Iterator[None]:
    """An ``OSError`` on a path the user gave (a full disk, a closed directory) is theirs."""
    try:
        yield
    except OSError as exc:
        where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
        reason = exc.strerror or type(exc).__name__
        said = f"{doing} ({reason})" if doing else f"{reason}{where}"  # ``doing``: what failed
        raise UserError(f"`{param}` {path}: {said}", param) from None
