"""``iallreduce_sum16_``: sums of bfloat16 and float16 held as ``uint16`` bits, under a real
``mpiexec`` on every host transport: every rank gets the same bits, the sum is right to the
dtype's rounding of each partial sum, and 2 bytes a value are counted."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.parallel.comm.test_comm import run_script
from xpnn.parallel.comm import SelfCommunicator

SUM16 = """
import sys
import numpy as np
from xpnn.parallel.comm import MpiHostCommunicator, ShmCommunicator
from xpnn.parallel.comm.narrow import from_bits, to_bits
from xpnn.runtime import init_world, run_guarded

UNIT = {"bfloat16": 2.0**-8, "float16": 2.0**-11}  # unit round-off: half the epsilon

def main():
    w = init_world()
    n = w.size
    shm = ShmCommunicator.create(w.mpi_comm)  # XPNN_RANKS_PER_NODE=1: a node per rank
    assert shm.nodes == n, shm.nodes
    for comm in (MpiHostCommunicator(w.mpi_comm), shm):
        for dtype, unit in UNIT.items():
            for size in (1, 7, 1000, 1 << 17):
                rng = np.random.default_rng([size, w.rank])
                values = (rng.standard_normal(size) * 100).astype(np.float32)
                bits = to_bits(np, values, dtype)
                mine = from_bits(np, bits, dtype, np.float64)
                before = comm.bytes_sent
                if comm is shm:
                    comm.cross_allreduce_sum16_(bits, dtype)
                else:
                    comm.iallreduce_sum16_(bits, dtype).wait()
                assert comm.bytes_sent - before == 2 * size, (comm.name, comm.bytes_sent)
                every = w.mpi_comm.allgather((bits, mine))
                assert all(np.array_equal(b, bits) for b, _ in every), "ranks differ"
                exact = sum(m for _, m in every)  # float64: exact for n float16 or bfloat16
                got = from_bits(np, bits, dtype, np.float64)
                # n - 1 partial sums, each rounded once: each off by unit x what it adds up
                bound = (n - 1) * unit * sum(np.abs(m) for _, m in every)
                assert np.all(np.abs(got - exact) <= bound), (comm.name, dtype, size)
                assert not np.array_equal(got, exact) or size < 1000  # it did round
    print(f"OK rank {w.rank}", flush=True)

sys.exit(run_guarded(init_world(), main))
"""


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_16_bit_sums_under_mpiexec(tmp_path: Path, ranks: int) -> None:
    proc, _ = run_script(tmp_path, SUM16, ranks, timeout=90, XPNN_RANKS_PER_NODE="1")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert all(f"OK rank {r}" in proc.stdout for r in range(ranks))


def test_one_process_sums_nothing_and_names_the_dtype() -> None:
    comm = SelfCommunicator()
    bits = np.arange(4, dtype=np.uint16)
    comm.iallreduce_sum16_(bits, "float16").wait()
    assert np.array_equal(bits, np.arange(4)) and comm.bytes_sent == 0
    with pytest.raises(ValueError, match="16-bit float 'float32'"):
        comm.iallreduce_sum16_(bits, "float32")
