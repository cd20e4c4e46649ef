"""A Python program's first backend gets the command line's thread set-up: BLAS's, OpenMP's
and Numba's pools held to the cores the process may run on, unless it set or exported a count."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from xpnn.backends import THREAD_VARS

REPORT = (
    "import json, numba, xpnn.backends as t; from threadpoolctl import threadpool_info; "
    "print(json.dumps({'set': t.threads_set(), 'numba': numba.get_num_threads(), "
    "'pools': sorted({i['num_threads'] for i in threadpool_info()})}))"
)


def _report(setup: str, env: dict | None = None) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    code = f"{setup}; {REPORT}"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
        env={**clean, **(env or {})}, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no affinity masks here")
def test_get_backend_holds_every_pool_to_the_processs_cores():
    """On one core of a larger machine, Numba's pool started a thread per core of the node."""
    got = _report(
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from xpnn.backends import get_backend; get_backend('numba')"
    )
    assert got == {"set": 1, "numba": 1, "pools": [1]}


def test_set_threads_before_the_backend_is_kept():
    got = _report("import xpnn; xpnn.set_threads(1); from xpnn.backends import get_backend; "
                  "get_backend('numba')")  # fmt: skip
    assert got == {"set": 1, "numba": 1, "pools": [1]}


def test_an_exported_count_is_the_users():
    got = _report("from xpnn.backends import get_backend; get_backend('numba')",
                  env={"OMP_NUM_THREADS": "1"})  # fmt: skip
    assert got["set"] is None


def test_a_bad_count_names_threads():
    from xpnn.backends import set_threads
    from xpnn.errors import UserError

    with pytest.raises(UserError, match="`threads` 0"):
        set_threads(0)
