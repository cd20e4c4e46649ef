"""--grad-dtype on a real GPU: CuPy has no bfloat16, so its bits come from integer arithmetic
(they must be ml_dtypes' on the host); device bits summed staged through the host (mpi-host)
and by NCCL's own 16-bit sums; a 2-rank CuPy run sends half the bytes.

Skipped (with the reason) where CuPy or a CUDA device is missing."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from conftest import cupy_or_skip, run_xpnn
from test_gpu_comm import GPUS, _nccl_available, run

from xpnn.parallel.comm.narrow import from_bits, native_dtype, to_bits

cupy = cupy_or_skip()
pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_device_bits_are_the_host_bits(dtype):
    rng = np.random.default_rng(0)
    scale = 10.0 ** rng.integers(-40, 38, 100_000)  # subnormal to past float16's range
    with np.errstate(over="ignore"):  # past the range: infinity, as on the device
        values = (rng.standard_normal(100_000) * scale).astype(np.float32)
        host = values.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16)
    bits = to_bits(cupy, cupy.asarray(values), dtype)
    assert bits.dtype == cupy.uint16
    np.testing.assert_array_equal(cupy.asnumpy(bits), host.view(np.uint16))
    back = from_bits(cupy, bits, dtype, cupy.float32)
    np.testing.assert_array_equal(cupy.asnumpy(back), host.astype(np.float32))
    if dtype == "bfloat16":
        assert native_dtype(cupy, dtype) is None  # the integer path is the one tested here


SUM16 = """
from xpnn.parallel.comm.narrow import from_bits, to_bits

def check_sum16(comm):
    n, r = comm.size, comm.rank
    for dtype in ("bfloat16", "float16"):
        values = cupy.arange(1 << 16, dtype=cupy.float32) % 251 * 0.5 + r
        bits = to_bits(cupy, values, dtype)
        before = comm.bytes_sent
        comm.iallreduce_sum16_(bits, dtype).wait()
        assert comm.bytes_sent - before == 2 * bits.size, (comm.name, comm.bytes_sent)
        got = from_bits(cupy, bits, dtype, cupy.float32)
        want = (cupy.arange(1 << 16, dtype=cupy.float32) % 251 * 0.5) * n + n * (n - 1) / 2
        want = from_bits(cupy, to_bits(cupy, want, dtype), dtype, cupy.float32)
        # halves and small integers below 256: exact in bfloat16's 8 significant bits
        assert bool(cupy.all(got == want)), (comm.name, dtype)
"""


def test_device_bits_summed_staged_through_the_host(tmp_path: Path) -> None:
    body = (
        SUM16
        + """
def main():
    comm = make_communicator(w, GPU, "mpi-host")
    check_sum16(comm)
    print(f"SUM16 OK {w.rank}", flush=True)

sys.exit(run_guarded(w, main))
"""
    )
    proc = run(tmp_path, body, 2)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.count("SUM16 OK") == 2


@pytest.mark.skipif(not _nccl_available(), reason="cupy.cuda.nccl not available")
def test_nccl_sums_16_bit_floats_itself(tmp_path: Path) -> None:
    """One rank on one GPU, or a rank a GPU where there are two."""
    ranks = 2 if GPUS >= 2 else 1
    body = (
        SUM16
        + """
def main():
    comm = make_communicator(w, GPU, "nccl")
    assert comm.name == "nccl", (comm.name, comm.detail)
    check_sum16(comm)
    print(f"NCCL16 OK {w.rank}", flush=True)

sys.exit(run_guarded(w, main))
"""
    )
    proc = run(tmp_path, body, ranks)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert proc.stdout.count("NCCL16 OK") == ranks


RUN = [
    "--backend", "cupy", "--comm", "mpi-host", "--dataset", "synthetic", "--synthetic-size",
    "600", "--epochs", "2", "--batch-size", "60", "--hidden", "32,16", "--no-progress",
]  # fmt: skip


def test_two_cupy_ranks_send_half_the_bytes(tmp_path: Path) -> None:
    records = {}
    for dtype in ("float32", "bfloat16", "float16"):
        metrics = tmp_path / f"{dtype}.jsonl"
        proc = run_xpnn([*RUN, "--grad-dtype", dtype, "--metrics", str(metrics)], ranks=2)
        assert proc.returncode == 0, proc.stderr
        records[dtype] = [json.loads(line) for line in metrics.read_text().splitlines()]
    full = records["float32"][0]["comm_bytes"]
    for dtype in ("bfloat16", "float16"):
        done = records[dtype][-1]
        assert records[dtype][0]["comm_bytes"] * 2 == full and done["ranks_agree"], dtype
        assert done["test_loss"] == pytest.approx(records["float32"][-1]["test_loss"], rel=0.1)
