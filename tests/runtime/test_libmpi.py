"""One finder of the loaded MPI library, for MPI_Init_thread and for the CUDA-awareness query:
it opens the library mpi4py loaded, never another."""

import subprocess
import sys

SCRIPT = """
from mpi4py import rc
rc.initialize = False  # loaded, not started
from mpi4py import MPI
from xpnn.runtime.world import loaded_libmpi
from xpnn.parallel.comm import cuda_aware
lib = loaded_libmpi("MPI_Init_thread")
assert lib is not None and hasattr(lib, "MPI_Get_version")
assert loaded_libmpi("MPI_No_such_call") is None
found = cuda_aware._loaded_libmpi()
assert found is not None and hasattr(found, "MPI_Get_version")
print("found", lib._name)
"""


def test_the_library_mpi4py_loaded_is_found_once():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "libmpi" in proc.stdout, proc.stdout


def test_without_mpi_loaded_nothing_is_found():
    script = "from xpnn.runtime.world import loaded_libmpi; print(loaded_libmpi())"
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "None"
