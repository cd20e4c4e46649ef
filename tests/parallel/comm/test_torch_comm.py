"""Communicators move PyTorch tensors (real ``mpiexec``): CPU tensors through DLPack with no
copy, and the staging path of device tensors (pinned host buffers, copies both ways), run
here with CPU tensors standing in for device ones, as no accelerator is at hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parallel.comm.test_comm import run_script
from xpnn.backends import get_backend
from xpnn.parallel.comm.mpi import CUPY, TORCH, arrays_of

MOVES = """
import sys
import torch
from xpnn.backends import get_backend
from xpnn.parallel.comm import make_communicator
from xpnn.parallel.comm.mpi import TorchArrays
from xpnn.runtime import init_world, run_guarded

STAGED = {staged}


class CpuAsDevice(TorchArrays):
    \"\"\"Every tensor taken for a device tensor: the staging path, run on the CPU.\"\"\"

    @staticmethod
    def is_device(buf):
        return isinstance(buf, torch.Tensor)


w = init_world()


def main():
    comm = make_communicator(w, get_backend("torch", "float64", device="cpu"), "mpi-host")
    if STAGED:
        comm._arrays = CpuAsDevice()
        comm._pool._arrays = comm._arrays
    r, n = w.rank, w.size
    for dtype in (torch.float64, torch.float32, torch.int64):
        buf = torch.arange(10, dtype=dtype) * (r + 1)
        view = buf[2:7]  # a view into a larger tensor: the result lands in the tensor itself
        comm.allreduce_(view)
        want = torch.arange(10, dtype=dtype)
        want[2:7] *= n * (n + 1) // 2
        want[:2] *= r + 1
        want[7:] *= r + 1
        assert torch.equal(buf, want), (dtype, buf, want)
    for _ in range(3):  # the staging pool's buffers are reused
        b = torch.full((2, 3), float(r))
        comm.iallreduce_(b, "max").wait()
        assert torch.equal(b, torch.full((2, 3), float(n - 1))), b
    b = torch.full((5,), float(r + 7))
    comm.bcast_(b, root=1)
    assert torch.equal(b, torch.full((5,), 8.0)), b
    if r == 0:
        comm.isend(torch.arange(4.0) + 100, dest=1, tag=3).wait()
    else:
        got = torch.zeros(4)
        comm.recv_(got, source=0, tag=3)
        assert torch.equal(got, torch.arange(4.0) + 100), got
    for counts in ([2] * n, [5] + [0] * (n - 1)):  # each rank its piece's sum, then all
        lo, hi = sum(counts[:r]), sum(counts[: r + 1])
        b = torch.arange(float(sum(counts))) * (r + 1)
        comm.ireduce_scatter_(b, counts).wait()
        want = torch.arange(float(sum(counts))) * (n * (n + 1) // 2)
        assert torch.equal(b[lo:hi], want[lo:hi]), (counts, b)
        b[:lo] = -1
        b[hi:] = -1
        comm.allgather_(b, counts)
        assert torch.equal(b, want), (counts, b)
    comm.ireduce_scatter_(torch.zeros(0), [0] * n).wait()
    comm.allgather_(torch.zeros(0), [0] * n)
    comm.allreduce_(torch.zeros(0))
    staged = comm._pool.allocated
    assert (staged > 0) == STAGED, staged
    print(f"rank {{r}} ok, {{staged}} staging buffers", flush=True)


sys.exit(run_guarded(w, main))
"""


@pytest.mark.mpi
@pytest.mark.parametrize("staged", [False, True], ids=["host-tensors", "staged"])
def test_two_ranks_move_torch_tensors(tmp_path: Path, staged: bool) -> None:
    proc, _ = run_script(tmp_path, MOVES.format(staged=staged), 2, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(" ok, ") == 2, proc.stdout


def test_cpu_tensors_are_host_buffers_and_each_library_has_its_handling() -> None:
    assert not TORCH.is_device(torch.zeros(3)) and not CUPY.is_device(torch.zeros(3))
    assert arrays_of("torch") is TORCH and arrays_of("cupy") is CUPY
    assert get_backend("torch").array_library == "torch"
    assert get_backend("numba").array_library == "numpy"


def test_staging_buffers_have_the_tensors_dtype() -> None:
    host = TORCH.empty_pinned(5, TORCH.host_dtype(torch.zeros(1, dtype=torch.float32)))
    assert host.dtype.name == "float32" and host.shape == (5,)
    dev = torch.arange(5.0)
    TORCH.copy_out(dev, host)
    assert host.tolist() == [0, 1, 2, 3, 4]
    host[:] = 9
    assert TORCH.copy_back(dev, host) is None and dev.tolist() == [9] * 5  # CPU: no event
