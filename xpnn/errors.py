"""User-facing errors.

A ``UserError`` is a mistake the user can fix (a bad flag, a missing or corrupt file). The CLI
prints its message as one line on stderr and exits 2; anything else is a bug and exits 1.
"""


class UserError(Exception):
    """A problem with the user's input: one line naming the file or flag and what is wrong."""

    exit_code = 2
