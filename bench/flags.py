"""Flag types of the benchmarks: each refuses a bad value in one line naming what is wrong,
before anything is measured."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from pathlib import Path


def int_list(text: str) -> list[int]:
    """``1,2,4`` -> [1, 2, 4]; every value positive (repeats allowed: ``--hidden 64,64``)."""
    return _ints_at_least(text, 1, "integers like 1,2", "positive integers")


def float_list(text: str) -> list[float]:
    """``0.01,0.1`` -> [0.01, 0.1]; every value a finite number > 0."""
    values = [positive_float(v) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected numbers like 0.01,0.1, got {text!r}")
    return values


def distinct_int_list(text: str) -> list[int]:
    """``1,2,4`` -> [1, 2, 4]; every value positive, none given twice (each is one run)."""
    return _no_repeats(int_list(text), text)


def cpu_list(text: str) -> list[int]:
    """``0,1`` -> [0, 1]: CPU numbers, from 0. A CPU may be named twice: ``core_contention``
    then pins two processes to it, which is how it measures a core shared by two ranks."""
    return _ints_at_least(text, 0, "CPU numbers like 0,1", "CPU numbers like 0,1")


def _no_repeats(values: list, text: str) -> list:
    """``values`` unchanged, unless one of them is given twice: a usage error naming it."""
    seen: set = set()
    for v in values:
        if v in seen:
            raise argparse.ArgumentTypeError(f"{v!r} given twice in {text!r}")
        seen.add(v)
    return values


def _ints_at_least(text: str, low: int, form: str, kind: str) -> list[int]:
    """A comma list of integers, at least one, none below ``low``; the messages say what was
    expected: ``form`` for text that is not integers, ``kind`` for values that are too low."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {form}, got {text!r}") from None
    if not values or min(values) < low:
        raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}")
    if max(values) > MOST_INT:  # sizes and counts past C's int: typos, and crash NumPy or MPI
        raise argparse.ArgumentTypeError(f"values must be at most {MOST_INT}, got {text!r}")
    return values


MOST_INT = 2**31 - 1
MOST_RANKS = 4096  # processes one mpiexec of a benchmark may start: more is a typo


def rank_count(text: str) -> int:
    """``mpiexec -n``: 1 to ``MOST_RANKS``."""
    value = _int_at_least(text, 1)
    if value > MOST_RANKS:
        raise argparse.ArgumentTypeError(f"must be at most {MOST_RANKS} ranks, got {value}")
    return value


def rank_list(text: str) -> list[int]:
    """``1,2,4``: rank counts, each 1 to ``MOST_RANKS``."""
    values = int_list(text)
    if max(values) > MOST_RANKS:
        raise argparse.ArgumentTypeError(f"must be at most {MOST_RANKS} ranks, got {text!r}")
    return values


def message_size(text: str) -> int:
    """Bytes of the largest message: 4 (one float32) to 2^31 - 1."""
    value = _int_at_least(text, 4)
    if value > MOST_INT:
        raise argparse.ArgumentTypeError(f"must be at most {MOST_INT} bytes, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1)


def timed_epochs(text: str) -> int:
    """Epochs per run where the first is not timed: 2 at least, else nothing would be."""
    value = _int_at_least(text, 1)
    if value < 2:
        raise argparse.ArgumentTypeError(
            f"must be >= 2, got {value}: the first epoch includes compilation and is not timed"
        )
    return value


def nonneg_int(text: str) -> int:
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    if value > MOST_INT:  # counts past C's int: typos, and crash NumPy or MPI
        raise argparse.ArgumentTypeError(f"must be at most {MOST_INT}, got {value}")
    return value


def nonneg_float(text: str) -> float:
    """A finite number >= 0 (``nan`` and ``inf`` are refused: they break comparisons, waits and
    JSON)."""
    value = _finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds to allow, a budget)."""
    value = _finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    if value > MOST_FLOAT:  # past this, timeouts overflow the C types that wait
        raise argparse.ArgumentTypeError(f"must be at most {MOST_FLOAT:g}, got {text}")
    return value


MOST_FLOAT = 1e9  # seconds (31 years) or MiB: anything larger is a typo


def fraction(text: str) -> float:
    """A number in (0, 1]: an accuracy to reach."""
    value = _finite_float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """A parser for a comma list of names among ``choices``: at least one, no unknown name,
    none given twice."""
    known = ",".join(choices)

    def parse(text: str) -> list[str]:
        names = [t.strip() for t in text.split(",") if t.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"empty: give a comma list of {known}")
        bad = [n for n in names if n not in choices]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(map(repr, bad))}: choose among {known}"
            )
        return _no_repeats(names, text)

    return parse


def data_dir_problem(dataset: str, data_dir: str) -> str | None:
    """Why ``data_dir`` does not hold ``dataset``'s four IDX files (None: it does), as xpnn's
    ``--data-dir`` lookup says it (``--data-dir DIR: no such directory``, ``...: missing ...``)."""
    from xpnn.commands.flags import flag_words
    from xpnn.data import find_files
    from xpnn.errors import UserError

    try:
        find_files(dataset, data_dir, download=False)
    except UserError as exc:
        return flag_words(str(exc))
    return None


def file_path(text: str) -> Path:
    """A file name to write (the figure goes beside it, as NAME.png): not empty, not ``.``."""
    path = Path(text)
    if not text.strip() or path.name in ("", ".", ".."):
        raise argparse.ArgumentTypeError(f"expected a file name, got {text!r}")
    return path


def add_common(p: argparse.ArgumentParser, repeats_dest: str | None) -> None:
    """The flags every benchmark takes, declared here once: ``--quiet-wait`` and, where the
    benchmark counts its repeats under another name (``--rounds``, ``--iters``), ``--repeats``
    as that flag's other spelling."""
    p.add_argument(
        "--quiet-wait",
        type=nonneg_float,
        default=0.0,
        metavar="SECONDS",
        help="first wait up to this long for the load average to fall below the cores "
        "(the records say whether it did)",
    )
    if repeats_dest is not None and "--repeats" not in p._option_string_actions:
        p.add_argument(
            "--repeats",
            dest=repeats_dest,
            type=positive_int,
            default=argparse.SUPPRESS,
            help=f"the same as --{repeats_dest.replace('_', '-')}",
        )
