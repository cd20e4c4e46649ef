"""Device-buffer communicators on a real GPU, under a real ``mpiexec``.

Skipped (with the reason) where CuPy or a CUDA device is missing. On a one-GPU machine the
two-rank runs share that GPU, which is exactly the case where ``--comm nccl`` must fall back;
true two-rank NCCL runs only where there are two GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ROOT, mpiexec_path

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


def _gpu_count() -> int:
    try:
        import cupy
    except Exception as exc:  # ImportError, or a CUDA library that fails to load
        pytest.skip(f"CuPy not importable: {exc}", allow_module_level=True)
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # no driver: CUDARuntimeError
        pytest.skip(f"no CUDA device: {exc}", allow_module_level=True)
    return 0


GPUS = _gpu_count()
if GPUS < 1:
    pytest.skip("no CUDA device", allow_module_level=True)


PRELUDE = """
import os, sys
import numpy as np
import cupy
from types import SimpleNamespace
from xpnn.parallel.comm import make_communicator
from xpnn.runtime import init_world, run_guarded

w = init_world()
cupy.cuda.Device(w.local_rank % cupy.cuda.runtime.getDeviceCount()).use()
GPU = SimpleNamespace(name="cupy", is_gpu=True, xp=cupy)


def check_collectives(comm):
    n, r = comm.size, comm.rank
    for dtype in (cupy.float32, cupy.float64):
        for size in (1, 1000, 1 << 18):
            base = cupy.arange(size, dtype=dtype) % 97
            buf = base + r
            comm.allreduce_(buf, "sum")
            assert cupy.array_equal(buf, base * n + n * (n - 1) / 2), ("sum", comm.name, size)
            buf = base * (r + 1)
            comm.allreduce_(buf, "max")
            assert cupy.array_equal(buf, base * n), ("max", comm.name, size)
            buf = base - r
            comm.allreduce_(buf, "min")
            assert cupy.array_equal(buf, base - (n - 1)), ("min", comm.name, size)
            buf = base.copy() if r == 0 else cupy.full(size, -1, dtype)
            comm.bcast_(buf, root=0)
            assert cupy.array_equal(buf, base), ("bcast", comm.name, size)
        # several non-blocking reductions of equal size in flight, twice (pool reuse)
        for step in range(2):
            bufs = [cupy.full(4096, r + k + step, dtype) for k in range(3)]
            handles = [comm.iallreduce_(b) for b in bufs]
            for k, (b, h) in enumerate(zip(bufs, handles)):
                h.wait()
                want = n * (k + step) + n * (n - 1) / 2
                assert bool(cupy.all(b == want)), ("iallreduce", comm.name, k, step)
        # each rank its piece's sum, then every piece to every rank (staged through the host)
        counts = [3 + 2 * k for k in range(n)]
        lo, hi = sum(counts[:r]), sum(counts[: r + 1])
        base = cupy.arange(sum(counts), dtype=dtype) % 97
        buf = base + r
        comm.ireduce_scatter_(buf, counts).wait()
        want = base * n + n * (n - 1) / 2
        assert cupy.array_equal(buf[lo:hi], want[lo:hi]), ("reduce-scatter", comm.name)
        buf[:lo] = -1
        buf[hi:] = -1
        comm.allgather_(buf, counts)
        assert cupy.array_equal(buf, want), ("all-gather", comm.name)
    # a kernel queued right before the reduction must be complete before it is read
    big = cupy.zeros(1 << 22, cupy.float32)
    big += r + 1
    comm.allreduce_(big)
    assert float(big[-1]) == n * (n + 1) / 2, ("ordering", comm.name)
    # host buffers still work on a GPU communicator
    h = np.full(8, float(r))
    comm.allreduce_(h)
    assert np.all(h == n * (n - 1) / 2)
    assert comm.allreduce_host([1.0])[0] == n
    comm.barrier()
"""


def run(tmp_path: Path, body: str, ranks: int, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / f"gpu_{ranks}_{abs(hash(body)) % 10**8}.py"
    script.write_text(textwrap.dedent(PRELUDE) + textwrap.dedent(body))
    full_env = {k: v for k, v in os.environ.items() if k != "XPNN_CUDA_AWARE"}
    full_env.update(PYTHONUNBUFFERED="1", **env)
    full_env["PYTHONPATH"] = str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run(
        [mpiexec_path(), "-n", str(ranks), sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        env=full_env,
    )


def test_host_staged_device_buffers(tmp_path: Path) -> None:
    body = """
    def main():
        comm = make_communicator(w, GPU, "mpi-host")
        assert comm.name == "mpi-host" and comm.fallback_reason is None
        check_collectives(comm)
        # pinned buffers: one per (size, dtype) in flight, reused across steps
        pool = comm._pool
        before = pool.allocated
        for _ in range(5):
            b = cupy.ones(12345, cupy.float32)
            comm.allreduce_(b)
        assert pool.allocated - before <= 1, pool.allocated
        print(f"STAGED OK {w.rank} pinned {pool.allocated}", flush=True)

    sys.exit(run_guarded(w, main))
    """
    proc = run(tmp_path, body, 2)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.count("STAGED OK") == 2


def test_explicit_requests_on_a_shared_gpu_fall_back(tmp_path: Path) -> None:
    if GPUS >= 2:
        pytest.skip("each rank has its own GPU here; the shared-GPU fallback needs one GPU")
    body = """
    from xpnn.parallel.comm.cuda_aware import detect_cuda_aware

    def main():
        aware = detect_cuda_aware().aware
        comm = make_communicator(w, GPU, "nccl")
        want = "mpi-cuda" if aware else "mpi-host"
        assert comm.name == want, comm.name
        assert "ranks 0 and 1 share GPU 0 (NCCL refuses that)" in comm.fallback_reason
        check_collectives(comm)
        comm = make_communicator(w, GPU, "auto")
        assert comm.name == want and comm.fallback_reason is None, comm.name
        comm = make_communicator(w, GPU, "mpi-cuda")
        if not aware:
            assert comm.name == "mpi-host", comm.name
            assert comm.fallback_reason.startswith("`comm` mpi-cuda: MPI is not CUDA-aware")
        print(f"FALLBACK OK {w.rank}", flush=True)

    sys.exit(run_guarded(w, main))
    """
    proc = run(tmp_path, body, 2)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.count("FALLBACK OK") == 2
    note = "xpnn: `comm` nccl: ranks 0 and 1 share GPU 0 (NCCL refuses that); falling back to "
    assert proc.stderr.count(note) == 1, proc.stderr  # printed once, by rank 0


def test_mpi_cuda_when_forced_aware_single_rank(tmp_path: Path) -> None:
    """XPNN_CUDA_AWARE=1 on one rank: the device buffer goes to MPI as is. With a single
    rank MPI never reads the buffer for a reduction, so this tests the plumbing only."""
    body = """
    def main():
        comm = make_communicator(w, GPU, "mpi-cuda")
        assert comm.name == "mpi-cuda" and comm.fallback_reason is None, comm.name
        b = cupy.arange(10, dtype=cupy.float32)
        comm.allreduce_(b)
        comm.iallreduce_(b).wait()
        comm.bcast_(b)
        comm.barrier()
        assert cupy.array_equal(b, cupy.arange(10, dtype=cupy.float32))
        print("MPI-CUDA OK", flush=True)

    sys.exit(run_guarded(w, main))
    """
    proc = run(tmp_path, body, 1, XPNN_CUDA_AWARE="1")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "MPI-CUDA OK" in proc.stdout


def _nccl_available() -> bool:
    try:
        from cupy.cuda import nccl

        return bool(nccl.available)
    except Exception:
        return False


@pytest.mark.skipif(not _nccl_available(), reason="cupy.cuda.nccl not available")
def test_nccl_single_rank(tmp_path: Path) -> None:
    body = """
    def main():
        comm = make_communicator(w, GPU, "nccl")
        assert comm.name == "nccl" and comm.fallback_reason is None, comm.name
        check_collectives(comm)
        print("NCCL1 OK", flush=True)

    sys.exit(run_guarded(w, main))
    """
    proc = run(tmp_path, body, 1)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "NCCL1 OK" in proc.stdout


@pytest.mark.skipif(not _nccl_available(), reason="cupy.cuda.nccl not available")
@pytest.mark.skipif(GPUS < 2, reason="two-rank NCCL needs two GPUs (NCCL refuses a shared GPU)")
def test_nccl_two_ranks(tmp_path: Path) -> None:
    body = """
    def main():
        comm = make_communicator(w, GPU, "auto")
        assert comm.name == "nccl", (comm.name, comm.detail)
        check_collectives(comm)
        print(f"NCCL2 OK {w.rank}", flush=True)

    sys.exit(run_guarded(w, main))
    """
    proc = run(tmp_path, body, 2)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.count("NCCL2 OK") == 2
