"""``--comm mpi-cuda`` on a really CUDA-aware MPI: the Open MPI that ``ci/build-cuda-mpi.sh``
builds, two ranks sharing one GPU (CUDA IPC through Open MPI's smcuda transport).

Device buffers go to MPI as they are, and every result must equal host staging's
(``mpi-host``) and one NumPy rank's. Skipped where CuPy or a CUDA device is missing, or where
the prefix is not built (the skip names the command that builds it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, cupy_or_skip
from cuda_mpi_prefix import cuda_mpi_env_or_skip

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

cupy_or_skip()

FLOAT64_RUN = [
    "--dataset", "synthetic", "--synthetic-size", "600", "--epochs", "2", "--batch-size", "70",
    "--dtype", "float64", "--no-progress", "--hidden", "48,40,24",
]  # fmt: skip


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return cuda_mpi_env_or_skip()


def _run(env: dict[str, str], cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _xpnn(env: dict[str, str], ranks: int, args: list[str]) -> subprocess.CompletedProcess:
    return _run(env, ["mpirun", "-n", str(ranks), sys.executable, "-m", "xpnn", *args])


def _params(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def _done(metrics: Path) -> dict:
    return json.loads(metrics.read_text().splitlines()[-1])


def test_detection_says_aware_on_the_gpu(env: dict[str, str]) -> None:
    code = (
        "from xpnn.parallel.comm.cuda_aware import detect_cuda_aware\n"
        "a = detect_cuda_aware()\n"
        "print(a.aware, a.library, a.cuda_problem, a.reason, sep='|')\n"
    )
    proc = _run(env, [sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "True|True|None|MPIX_Query_cuda_support() = 1"


def test_device_buffer_collectives_over_mpi_cuda(env: dict[str, str], tmp_path: Path) -> None:
    """Every call the trainer and the model-parallel layers make, on device buffers, 2 ranks."""
    script = tmp_path / "collectives.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import cupy
            from types import SimpleNamespace
            from xpnn.parallel.comm import make_communicator
            from xpnn.runtime import init_world, run_guarded

            w = init_world()
            cupy.cuda.Device(w.local_rank % cupy.cuda.runtime.getDeviceCount()).use()
            GPU = SimpleNamespace(name="cupy", is_gpu=True, xp=cupy)

            def main():
                comm = make_communicator(w, GPU, "mpi-cuda")
                assert comm.name == "mpi-cuda" and comm.fallback_reason is None, comm.name
                n, r = comm.size, comm.rank
                for dtype in (cupy.float32, cupy.float64):
                    for size in (1, 1000, 1 << 20):
                        base = cupy.arange(size, dtype=dtype) % 97
                        buf = base + r
                        comm.allreduce_(buf, "sum")
                        assert cupy.array_equal(buf, base * n + n * (n - 1) / 2), size
                        buf = base * (r + 1)
                        comm.allreduce_(buf, "max")
                        assert cupy.array_equal(buf, base * n), size
                        bufs = [base + r + k for k in range(3)]
                        handles = [comm.iallreduce_(b) for b in bufs]
                        for k, (b, h) in enumerate(zip(bufs, handles)):
                            h.wait()
                            assert cupy.array_equal(b, (base + k) * n + n * (n - 1) / 2), k
                        buf = base + 10 * r
                        comm.bcast_(buf, root=1)
                        assert cupy.array_equal(buf, base + 10), size
                        if r == 0:
                            comm.isend(base * 3, 1, tag=7).wait()
                        else:
                            got = cupy.empty_like(base)
                            comm.recv_(got, 0, tag=7)
                            assert cupy.array_equal(got, base * 3), size
                comm.barrier()
                print(f"MPI-CUDA OK {r}", flush=True)

            sys.exit(run_guarded(w, main))
            """
        )
    )
    proc = _run(env, ["mpirun", "-n", "2", sys.executable, str(script)])
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.count("MPI-CUDA OK") == 2, proc.stdout


@pytest.mark.parametrize("bucket", [None, "0.001"])
def test_mpi_cuda_trains_without_falling_back_and_equals_mpi_host(
    env: dict[str, str], tmp_path: Path, bucket: str | None
) -> None:
    """Two ranks on one GPU: the run line says mpi-cuda, nothing falls back, and the
    parameters equal host staging's (float64, 1e-10). 1 kB buckets: many reductions in flight."""
    extra = ["--bucket-mb", bucket] if bucket else []
    params = {}
    for comm in ("mpi-cuda", "mpi-host"):
        saved, metrics = tmp_path / f"{comm}.npz", tmp_path / f"{comm}.jsonl"
        args = [*FLOAT64_RUN, "--backend", "cupy", "--comm", comm, *extra]
        proc = _xpnn(env, 2, [*args, "--save", str(saved), "--metrics", str(metrics)])
        assert proc.returncode == 0, proc.stderr + proc.stdout
        assert "falling back" not in proc.stderr, proc.stderr
        assert f"comm {comm}, 2 rank(s)" in proc.stdout, proc.stdout
        done = _done(metrics)
        assert done["comm"] == comm and done["ranks_agree"], done
        params[comm] = _params(saved)
    for name, ref in params["mpi-host"].items():
        np.testing.assert_allclose(params["mpi-cuda"][name], ref, rtol=1e-10, err_msg=name)


@pytest.mark.parametrize(
    ("parallel", "schedule"), [("tensor", None), ("pipeline", "gpipe"), ("pipeline", "1f1b")]
)
def test_model_parallel_over_mpi_cuda_equals_one_numpy_rank(
    env: dict[str, str], tmp_path: Path, parallel: str, schedule: str | None
) -> None:
    """Split layers allreduce device activations; pipeline stages send them with Isend/Recv:
    over mpi-cuda, with nothing staged through the host, they compute the one-rank run."""
    base = [*FLOAT64_RUN, "--parallel", parallel]
    if schedule:
        base += ["--microbatches", "3", "--pipeline-schedule", schedule]
    one, two, metrics = tmp_path / "1.npz", tmp_path / "2.npz", tmp_path / "2.jsonl"
    proc = _xpnn(env, 1, [*base, "--backend", "numpy", "--save", str(one)])
    assert proc.returncode == 0, proc.stderr
    args = [*base, "--backend", "cupy", "--comm", "mpi-cuda", "--metrics", str(metrics)]
    proc = _xpnn(env, 2, [*args, "--save", str(two)])
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "falling back" not in proc.stderr, proc.stderr
    assert _done(metrics)["model_comm"] == "mpi-cuda", _done(metrics)
    ref, got = _params(one), _params(two)
    for name, want in ref.items():
        scale = np.abs(want).max()
        np.testing.assert_allclose(got[name], want, rtol=0, atol=1e-10 * scale, err_msg=name)
