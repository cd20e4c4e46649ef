"""CUDA-awareness detection: every branch with faked inputs, and the real answer here:
the mpich wheel (never aware) and, where it is built, the CUDA-aware Open MPI prefix (built
aware, yet not usable on a machine without a CUDA driver)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT, TINY_FLOAT64_RUN
from cuda_mpi_prefix import cuda_mpi_env_or_skip

from xpnn.errors import UserError
from xpnn.parallel.comm.cuda_aware import (
    CudaAwareness,
    cuda_runtime_problem,
    detect_cuda_aware,
    nonblocking_device_collectives,
)


def _fail() -> int:
    raise AssertionError("must not be asked")


def _usable() -> None:
    """CUDA runs here (a faked driver with a device)."""
    return None


def _aware(reason: str) -> CudaAwareness:
    return CudaAwareness(True, reason, library=True)


def test_env_override_wins_over_everything() -> None:
    got = detect_cuda_aware(
        {"XPNN_CUDA_AWARE": "1"},
        alloc_kinds=lambda: _fail(),
        query_cuda_support=_fail,
        cuda_problem=_usable,
    )
    assert got == _aware("XPNN_CUDA_AWARE=1")
    got = detect_cuda_aware(
        {"XPNN_CUDA_AWARE": "0"}, alloc_kinds="cuda", query_cuda_support=_fail, cuda_problem=_fail
    )
    assert got == CudaAwareness(False, "XPNN_CUDA_AWARE=0")


@pytest.mark.parametrize("value", ["yes", "true", "2", "-1"])
def test_env_override_bad_value_names_the_variable(value: str) -> None:
    with pytest.raises(UserError, match=f"XPNN_CUDA_AWARE={value}"):
        detect_cuda_aware({"XPNN_CUDA_AWARE": value}, alloc_kinds=None, query_cuda_support=None)


def test_empty_env_value_means_unset() -> None:
    got = detect_cuda_aware({"XPNN_CUDA_AWARE": ""}, alloc_kinds=None, query_cuda_support=None)
    assert not got.aware


@pytest.mark.parametrize(
    "kinds", ["mpi,system,cuda", "cuda", "mpi,cuda:device", "mpi,system,cuda:host:device"]
)
def test_alloc_kinds_with_cuda_device_is_aware_before_query(kinds: str) -> None:
    got = detect_cuda_aware({}, alloc_kinds=kinds, query_cuda_support=_fail, cuda_problem=_usable)
    assert got == _aware(f"mpi_memory_alloc_kinds={kinds}")
    # a callable works as well as the value
    got = detect_cuda_aware(
        {}, alloc_kinds=lambda: kinds, query_cuda_support=_fail, cuda_problem=_usable
    )
    assert got.aware


def test_alloc_kinds_without_cuda_falls_through_to_query() -> None:
    # "mpi,system" is what a library reports when no cuda kind was requested: not conclusive
    got = detect_cuda_aware(
        {}, alloc_kinds="mpi,system", query_cuda_support=lambda: 1, cuda_problem=_usable
    )
    assert got == _aware("MPIX_Query_cuda_support() = 1")
    got = detect_cuda_aware(
        {}, alloc_kinds="mpi,system", query_cuda_support=lambda: 0, cuda_problem=_fail
    )
    assert got == CudaAwareness(
        False, "mpi_memory_alloc_kinds=mpi,system (no cuda); MPIX_Query_cuda_support() = 0"
    )


def test_cuda_host_only_is_not_device_aware() -> None:
    got = detect_cuda_aware({}, alloc_kinds="mpi,cuda:host", query_cuda_support=None)
    assert not got.aware
    assert "mpi_memory_alloc_kinds=mpi,cuda:host (no cuda)" in got.reason


def test_no_info_key_uses_query() -> None:
    got = detect_cuda_aware(
        {}, alloc_kinds=None, query_cuda_support=lambda: 1, cuda_problem=_usable
    )
    assert got.aware and got.reason == "MPIX_Query_cuda_support() = 1"
    got = detect_cuda_aware({}, alloc_kinds=lambda: None, query_cuda_support=lambda: 0)
    assert got == CudaAwareness(False, "no mpi_memory_alloc_kinds; MPIX_Query_cuda_support() = 0")


def test_nothing_known_is_not_aware() -> None:
    got = detect_cuda_aware({}, alloc_kinds=None, query_cuda_support=None)
    assert got == CudaAwareness(False, "no mpi_memory_alloc_kinds; no MPIX_Query_cuda_support")
    got = detect_cuda_aware({}, alloc_kinds=None, query_cuda_support=lambda: None)
    assert not got.aware and "no MPIX_Query_cuda_support" in got.reason


def test_broken_query_is_not_aware() -> None:
    def broken() -> int:
        raise OSError("symbol lookup failed")

    got = detect_cuda_aware({}, alloc_kinds="mpi,system", query_cuda_support=broken)
    assert not got.aware and "symbol lookup failed" in got.reason


NO_DRIVER = "no CUDA driver (libcuda.so.1 cannot be loaded: cannot open shared object file)"


@pytest.mark.parametrize(
    ("env", "kinds", "query"),
    [
        ({}, "mpi,system", lambda: 1),
        ({}, "mpi,cuda", _fail),
        ({"XPNN_CUDA_AWARE": "1"}, None, _fail),
    ],
)
def test_an_aware_library_without_cuda_here_is_not_aware(env, kinds, query) -> None:
    """A library built CUDA-aware on a machine with no driver or no device: never 'aware',
    and the reason says the library is aware and which of the two is missing."""
    for problem in (NO_DRIVER, "no CUDA device (the driver sees 0 devices)"):
        got = detect_cuda_aware(
            env, alloc_kinds=kinds, query_cuda_support=query, cuda_problem=lambda p=problem: p
        )
        assert not got.aware and got.library and got.cuda_problem == problem
        assert got.reason.startswith("the library is CUDA-aware (")
        assert got.reason.endswith(f"but device buffers cannot be used here: {problem}")


class FakeDriver:
    """Stands for libcuda.so.1: cuInit's and cuDeviceGetCount's answers are given."""

    def __init__(self, init: int = 0, count: int = 1, count_rc: int = 0) -> None:
        self.init, self.count, self.count_rc = init, count, count_rc

    def cuInit(self, flags: int) -> int:  # noqa: N802 - the driver's name
        assert flags == 0
        return self.init

    def cuDeviceGetCount(self, ptr) -> int:  # noqa: N802, ANN001
        ptr._obj.value = self.count
        return self.count_rc

    def cuGetErrorName(self, code: int, ptr) -> int:  # noqa: N802, ANN001
        ptr._obj.value = b"CUDA_ERROR_UNKNOWN" if code == 999 else None
        return 0 if code == 999 else 1


def _loads(driver: FakeDriver):  # noqa: ANN202
    def load(name: str) -> FakeDriver:
        assert name == "libcuda.so.1"
        return driver

    return load


def test_cuda_runtime_problem_names_what_is_missing() -> None:
    def no_library(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    assert cuda_runtime_problem(no_library) == (
        "no CUDA driver (libcuda.so.1 cannot be loaded: cannot open shared object file: "
        "No such file or directory)"
    )
    assert cuda_runtime_problem(_loads(FakeDriver(init=100))) == (
        "no CUDA device (the driver reports CUDA_ERROR_NO_DEVICE)"
    )
    assert cuda_runtime_problem(_loads(FakeDriver(init=34))).startswith(
        "no CUDA driver (libcuda.so.1 is the toolkit's stub"
    )
    assert "INSUFFICIENT_DRIVER" in cuda_runtime_problem(_loads(FakeDriver(init=35)))
    assert cuda_runtime_problem(_loads(FakeDriver(init=999))) == (
        "CUDA driver failed to start (cuInit returned CUDA_ERROR_UNKNOWN (999))"
    )
    assert cuda_runtime_problem(_loads(FakeDriver(init=3))) == (
        "CUDA driver failed to start (cuInit returned 3)"
    )
    assert cuda_runtime_problem(_loads(FakeDriver(count=0))) == (
        "no CUDA device (the driver sees 0 devices)"
    )
    assert cuda_runtime_problem(_loads(FakeDriver(count_rc=999))).startswith(
        "no CUDA device (cuDeviceGetCount returned CUDA_ERROR_UNKNOWN"
    )
    assert cuda_runtime_problem(_loads(FakeDriver(count=2))) is None


def test_a_library_that_is_not_the_driver_is_no_driver() -> None:
    got = cuda_runtime_problem(lambda name: ctypes.CDLL(None))  # libc: no cuInit
    assert got is not None and got.startswith("no CUDA driver (cuInit failed:")


def test_open_mpi_takes_device_buffers_in_blocking_collectives_only() -> None:
    """Open MPI's libnbc would reduce device memory with the CPU: mpi-cuda must not call
    Iallreduce on a device buffer there."""
    assert not nonblocking_device_collectives("Open MPI v4.1.4, package: Open MPI root@x")
    assert not nonblocking_device_collectives("Open MPI v5.0.6, package: Open MPI")
    assert nonblocking_device_collectives("MPICH Version:      4.2.0")
    assert nonblocking_device_collectives("MVAPICH2-GDR Version 2.3.7")


@pytest.mark.mpi
def test_real_mpich_wheel_is_not_cuda_aware() -> None:
    """The library this environment loads (the mpich wheel in CI), asked for real (in a
    child: MPI must not start inside pytest)."""
    code = (
        "from xpnn.parallel.comm.cuda_aware import detect_cuda_aware, read_alloc_kinds, "
        "query_mpix_cuda_support\n"
        "from mpi4py import MPI\n"
        "print(MPI.Get_library_version().split()[0])\n"
        "print(read_alloc_kinds())\n"
        "print(query_mpix_cuda_support())\n"
        "a = detect_cuda_aware()\n"
        "print(a.aware)\n"
        "print(a.reason)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "XPNN_CUDA_AWARE"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0, proc.stderr
    library, kinds, query, aware, reason = proc.stdout.strip().splitlines()
    if query != "1":  # a library built without CUDA (the CUDA-aware one: tests below)
        assert aware == "False", reason
    if library == "MPICH":  # the mpich wheel this project depends on
        assert kinds == "mpi,system"
        assert query == "0"
        assert (
            reason == "mpi_memory_alloc_kinds=mpi,system (no cuda); MPIX_Query_cuda_support() = 0"
        )


# The CUDA-aware Open MPI that ci/build-cuda-mpi.sh builds (skipped where it is not built).


def _in_prefix(env: dict[str, str], *cmd: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )


@pytest.mark.mpi
def test_cuda_aware_open_mpi_is_aware_but_not_usable_without_cuda() -> None:
    """The real library answers MPIX_Query_cuda_support() = 1 everywhere; where CUDA cannot
    run (this machine has no driver) detection must still say not aware, and why."""
    env = cuda_mpi_env_or_skip()
    built = _in_prefix(env, "ompi_info", "--parsable", "--all")
    assert "mpi_built_with_cuda_support:value:true" in built.stdout, built.stderr
    code = (
        "import json\n"
        "from mpi4py import MPI\n"
        "from xpnn.parallel.comm.cuda_aware import detect_cuda_aware, query_mpix_cuda_support, "
        "read_alloc_kinds, cuda_runtime_problem\n"
        "a = detect_cuda_aware()\n"
        "print(json.dumps([MPI.Get_library_version(), read_alloc_kinds(), "
        "query_mpix_cuda_support(), cuda_runtime_problem(), a.aware, a.library, a.reason]))\n"
    )
    proc = _in_prefix(env, sys.executable, "-c", code)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr  # no CUDA warning either
    library, kinds, query, problem, aware, built_aware, reason = json.loads(proc.stdout)
    assert library.startswith("Open MPI v4.1"), library
    assert kinds is None  # an MPI 3.1 library: no mpi_memory_alloc_kinds
    assert query == 1 and built_aware
    if problem is None:  # a machine with a GPU: nothing stands in the way
        assert aware and reason == "MPIX_Query_cuda_support() = 1"
    else:
        assert not aware
        assert reason == (
            "the library is CUDA-aware (MPIX_Query_cuda_support() = 1) but device buffers "
            f"cannot be used here: {problem}"
        )


@pytest.mark.mpi
def test_info_and_a_two_rank_cpu_run_under_the_cuda_aware_open_mpi(tmp_path) -> None:
    """`xpnn info` says built aware and what is missing; `mpirun -n 2` trains on the CPU and
    prints no CUDA warning (env.sh silences Open MPI's missing-libcuda one)."""
    env = cuda_mpi_env_or_skip()
    info = _in_prefix(env, sys.executable, "-m", "xpnn", "info")
    assert info.returncode == 0 and not info.stderr, info.stderr
    assert "MPIX_Query_cuda_support(): 1" in info.stdout
    assert "library built CUDA-aware: yes" in info.stdout
    cuda_line = next(x for x in info.stdout.splitlines() if "CUDA driver and device:" in x)
    if "usable" not in cuda_line:
        assert "CUDA-aware: no (the library is CUDA-aware (MPIX_Query_cuda_support() = 1) " in (
            info.stdout
        )
    metrics = tmp_path / "m.jsonl"
    args = [*TINY_FLOAT64_RUN, "--comm", "mpi-host", "--metrics", str(metrics)]
    run = _in_prefix(env, "mpirun", "-n", "2", sys.executable, "-m", "xpnn", *args, timeout=300)
    assert run.returncode == 0, run.stderr + run.stdout
    assert "cuda" not in run.stderr.lower(), run.stderr
    done = json.loads(metrics.read_text().splitlines()[-1])
    assert done["event"] == "done" and done["world_size"] == 2 and done["comm"] == "mpi-host"
    assert done["ranks_agree"]
