"""A CPU backend keeps freed host arrays in the process: a step's large temporaries are
reused by the next step's without page faults (docs/decisions/host-malloc.md)."""

import os
import subprocess
import sys

import pytest

CYCLES = """
import resource
import numpy as np
from xpnn.backends import get_backend
from xpnn.backends import keep_freed_arrays

get_backend({backend!r}, "float64")
a = np.ones(2 << 20)  # 16 MiB, touched
del a
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    a = np.ones(2 << 20)
    del a
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, keep_freed_arrays())
"""


def _faults(backend: str, **env: str) -> tuple[int, str]:
    """(page faults of ten 16 MiB arrays allocated, filled and freed; a second call's answer)."""
    code = CYCLES.format(backend=backend)
    run = subprocess.run(
        [sys.executable, "-c", code],
        # NumPy asks for huge pages for large arrays: where the kernel grants them, a fresh
        # 16 MiB array costs 8 faults, not 4,096, and the count says nothing of malloc's reuse
        env=os.environ | {"NUMPY_MADVISE_HUGEPAGE": "0"} | env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    faults, again = run.stdout.split()
    return int(faults), again


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_a_cpu_backend_reuses_freed_arrays_without_page_faults(backend):
    faults, again = _faults(backend)
    assert faults < 20  # a fresh 16 MiB a cycle is 4,096 pages; glibc's own rule faulted ~500
    assert again == "False"  # once a process


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_malloc_thresholds_the_user_set_are_kept():
    faults, _ = _faults("numpy", MALLOC_MMAP_THRESHOLD_="131072")
    assert faults > 1000  # every array mapped afresh, as the user asked
