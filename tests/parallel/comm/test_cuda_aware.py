"""CUDA-awareness detection: every branch with faked inputs, and the real answer here."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from xpnn.errors import UserError
from xpnn.parallel.comm.cuda_aware import CudaAwareness, detect_cuda_aware


def _fail() -> int:
    raise AssertionError("must not be asked")


def test_env_override_wins_over_everything() -> None:
    got = detect_cuda_aware(
        {"XPNN_CUDA_AWARE": "1"}, alloc_kinds=lambda: _fail(), query_cuda_support=_fail
    )
    assert got == CudaAwareness(True, "XPNN_CUDA_AWARE=1")
    got = detect_cuda_aware({"XPNN_CUDA_AWARE": "0"}, alloc_kinds="cuda", query_cuda_support=_fail)
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
    got = detect_cuda_aware({}, alloc_kinds=kinds, query_cuda_support=_fail)
    assert got == CudaAwareness(True, f"mpi_memory_alloc_kinds={kinds}")
    # a callable works as well as the value
    assert detect_cuda_aware({}, alloc_kinds=lambda: kinds, query_cuda_support=_fail).aware


def test_alloc_kinds_without_cuda_falls_through_to_query() -> None:
    # "mpi,system" is what a library reports when no cuda kind was requested: not conclusive
    got = detect_cuda_aware({}, alloc_kinds="mpi,system", query_cuda_support=lambda: 1)
    assert got == CudaAwareness(True, "MPIX_Query_cuda_support() = 1")
    got = detect_cuda_aware({}, alloc_kinds="mpi,system", query_cuda_support=lambda: 0)
    assert got == CudaAwareness(
        False, "mpi_memory_alloc_kinds=mpi,system (no cuda); MPIX_Query_cuda_support() = 0"
    )


def test_cuda_host_only_is_not_device_aware() -> None:
    got = detect_cuda_aware({}, alloc_kinds="mpi,cuda:host", query_cuda_support=None)
    assert not got.aware
    assert "mpi_memory_alloc_kinds=mpi,cuda:host (no cuda)" in got.reason


def test_no_info_key_uses_query() -> None:
    got = detect_cuda_aware({}, alloc_kinds=None, query_cuda_support=lambda: 1)
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


@pytest.mark.mpi
def test_real_mpich_wheel_is_not_cuda_aware() -> None:
    """The real library, asked for real (in a child: MPI must not start inside pytest)."""
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
    assert aware == "False", reason
    if library == "MPICH":  # the mpich wheel this project depends on
        assert kinds == "mpi,system"
        assert query == "0"
        assert (
            reason == "mpi_memory_alloc_kinds=mpi,system (no cuda); MPIX_Query_cuda_support() = 0"
        )
