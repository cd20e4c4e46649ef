"""Node-shared runs priced from the calibration's measured shared exchange (a fence, then the
values the other ranks wrote read), against hand-computed cases on the round machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import mpiexec_path
from tests.planner.test_cost_model import RoundMachine, mlp_work
from xpnn.backends import get_backend
from xpnn.nn.models import cnn
from xpnn.planner.cost import Layout, predict
from xpnn.planner.work import model_work

FENCE, PER_BYTE = 2e-6, 1e-9  # the round machine's measured exchange: 2 us + 1 ns a byte


def shared_machine() -> RoundMachine:
    machine = RoundMachine(cores=2)
    machine.shared = {"2": [FENCE, PER_BYTE]}
    return machine


def test_shared_activations_pay_each_fence_and_the_others_part_of_the_activations():
    machine, work = shared_machine(), mlp_work()
    p = predict(machine, work, Layout(2, 1, "data", comm="auto"), 128, "sgd")
    # 7 fences; each rank reads the half the other wrote of 128 x (784+512 + 512+256 + 256+10)
    read = 0.5 * 128 * 2330 * 4
    assert p.syncs == 7
    assert p.comm_exposed == pytest.approx(7 * FENCE + read * PER_BYTE)
    assert p.comm_hidden == 0.0  # the fences sit between the layers: nothing hides them
    assert p.optimizer == pytest.approx(3 * work.params / 2 / 1e9)


def test_shared_gradients_read_the_others_rows_of_their_share_after_the_last_fence():
    machine = shared_machine()
    work = model_work(cnn(), (1, 28, 28), get_backend("numpy"))
    p = predict(machine, work, Layout(2, 1, "data", comm="auto"), 128, "sgd")
    rows = 0.5 * 690_590 * 4  # the other rank's row of this rank's half of the gradient
    assert p.syncs == 4 + 1
    assert p.comm_exposed + p.comm_hidden == pytest.approx(5 * FENCE + rows * PER_BYTE)
    # the backward (seconds on the round machine) hides the buckets' fences, not the last
    assert p.comm_exposed == pytest.approx(FENCE + rows * PER_BYTE)
    assert p.optimizer == pytest.approx(3 * work.params / 2 / 1e9)  # its share, no row pass


def test_a_calibration_without_the_exchange_prices_a_barrier_and_the_rows_as_before():
    machine, work = RoundMachine(cores=2), mlp_work()
    assert machine.shared_exchange(2, 100.0) is None
    p = predict(machine, work, Layout(2, 1, "data", comm="auto"), 128, "sgd")
    assert p.comm_exposed == pytest.approx(7 * (1e-6 + 1e-9 * 4))


def test_oversubscribed_ranks_fences_are_their_synchronizations_waits_not_the_exchange():
    machine, work = shared_machine(), mlp_work()
    machine.shared["4"] = [1e-3, 1e-9]  # 4 ranks on 2 cores: a fence that waits for turns
    assert machine.shared_exchange(4, 0.0) is None
    p = predict(machine, work, Layout(4, 1, "data", comm="auto"), 128, "sgd")
    assert p.comm_exposed == 0.0
    assert p.sync_wait == pytest.approx(7 * 1e-3)  # no phases measured: the fence, each


def test_the_calibration_file_keeps_the_shared_exchange(tmp_path):
    from xpnn.planner.machine import Machine, load, save

    machine = Machine({"cores": 2}, shared={"2": [FENCE, PER_BYTE]})
    save(machine, tmp_path / "cal.json")
    again = load(tmp_path / "cal.json")
    assert again.shared_exchange(2, 1000) == pytest.approx(FENCE + 1000 * PER_BYTE)
    assert again.digest() == machine.digest()
    # a file from before the exchange was measured keeps the digest it was recorded with
    bare = Machine({"cores": 2})
    assert "shared" not in bare.to_json() and "phases" not in bare.to_json()
    machine.phases = {"4": [[1e-4, 1.2e-3]]}
    save(machine, tmp_path / "cal.json")
    assert load(tmp_path / "cal.json").phases == {"4": [[1e-4, 1.2e-3]]}


@pytest.mark.mpi
def test_the_probe_fits_the_shared_exchange_on_real_ranks():
    code = (
        "import json; from mpi4py import MPI; from xpnn.planner.probe import shared_exchange;"
        "fit = shared_exchange(MPI.COMM_WORLD, range(10, 23, 4), 9);"
        "MPI.COMM_WORLD.Get_rank() or print(json.dumps(fit))"
    )
    proc = subprocess.run(
        [mpiexec_path(), "-n", "2", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    alpha, beta = json.loads(proc.stdout.strip().splitlines()[-1])
    assert alpha >= 0 and beta > 0  # the bytes read after a fence take time
