"""``python -m xpnn calibrate``, ``plan`` and ``explain`` end to end, through the real command
line, with the calibration cached in a temporary home."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import mpiexec_path, run_xpnn
from xpnn.errors import UserError
from xpnn.planner.machine import Machine, load, save

TINY = ["--dataset", "synthetic", "--synthetic-size", "256", "--batch-size", "64", "--hidden", "32"]


def round_calibration(path, cores=2):  # noqa: ANN001, ANN201
    """A calibration of round numbers: 1 GFLOP/s a thread for a few product sizes."""
    gemm = {}
    for threads in range(1, cores + 1):
        for size in (8, 64, 512):
            gemm[f"float32 {threads} {size} {size} {size} 1"] = 2 * size**3 / (1e9 * threads)
    machine = Machine(
        {"cores": cores, "host": "round"},
        gemm=gemm,
        bandwidth={f"float32 {t}": 1e9 for t in range(1, cores + 1)},
        comm={
            "2": {
                op: [1e-6, 1e-9]
                for op in ("allreduce", "reduce_scatter", "allgather", "bcast", "sendrecv")
            }
        },  # fmt: skip
        crowding={"4": 2.0},
    )
    save(machine, path)
    return path


def test_a_calibration_file_round_trips_and_a_damaged_one_is_refused(tmp_path):
    path = round_calibration(tmp_path / "cal.json")
    again = load(path)
    assert again.gemm and again.cores == 2
    (tmp_path / "bad.json").write_text('{"version": 1, "key": {"cores": 0}}')
    with pytest.raises(UserError, match="damaged"):
        load(tmp_path / "bad.json")
    os.symlink(path, tmp_path / "link.json")
    with pytest.raises(UserError, match="cannot read"):  # never read through a planted link
        load(tmp_path / "link.json")


def test_plan_ranks_every_layout_for_another_machine_from_its_calibration(tmp_path):
    cal = round_calibration(tmp_path / "cal.json", cores=4)
    proc = run_xpnn(["plan", "--model", "mlp", *TINY, "--calibration", str(cal), "--json"])
    assert proc.returncode == 0, proc.stderr
    plans = json.loads(proc.stdout)
    steps = [p["step_s"] for p in plans]
    assert steps == sorted(steps) and len(plans) > 5
    layouts = {(p["layout"]["ranks"], p["layout"]["parallel"]) for p in plans}
    assert {(1, "data"), (2, "data"), (4, "data"), (2, "tensor"), (2, "pipeline")} <= layouts
    for p in plans:  # every plan says how to run it and what it holds
        assert "--threads" in p["flags"] and p["rate"] > 0 and p["memory"]["parameters"] > 0
    table = run_xpnn(["plan", "--model", "mlp", *TINY, "--calibration", str(cal)])
    assert table.returncode == 0, table.stderr
    assert "fastest: " in table.stdout and "samples/s" in table.stdout


def test_plan_refuses_a_bad_flag_in_one_line(tmp_path):
    cal = round_calibration(tmp_path / "cal.json")
    proc = run_xpnn(["plan", "--model", "mlp", "--batch-size", "0", "--calibration", str(cal)])
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "batch" in proc.stderr
    proc = run_xpnn(["plan", "--calibration", str(tmp_path / "none.json")])
    assert proc.returncode == 2 and "none.json" in proc.stderr


def test_explain_sets_a_measured_run_beside_its_prediction(tmp_path):
    metrics = tmp_path / "m.jsonl"
    args = ["--model", "mlp", *TINY, "--epochs", "1", "--threads", "1", "--no-progress"]
    run = run_xpnn([*args, "--backend", "numpy", "--metrics", str(metrics)])
    assert run.returncode == 0, run.stderr
    cal = round_calibration(tmp_path / "cal.json")
    proc = run_xpnn(["explain", str(metrics), "--calibration", str(cal), "--hidden", "32"])
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    step = next(line for line in lines if line.startswith("step"))
    measured, predicted = (float(v) for v in step.split()[1:3])
    record = json.loads(metrics.read_text().splitlines()[0])
    assert measured == pytest.approx(1e3 * 64 / record["samples_per_s"], rel=1e-2)
    assert predicted > 0
    assert lines[-1].startswith("largest gap: ")
    bad = run_xpnn(["explain", "/dev/zero", "--calibration", str(cal)])
    assert bad.returncode == 2 and "not a regular file" in bad.stderr


@pytest.mark.mpi
def test_the_probe_fits_every_collective_on_real_ranks():
    proc = subprocess.run(
        [mpiexec_path(), "-n", "2", sys.executable, "-m", "xpnn.planner.probe", "--quick"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["ranks"] == 2 and found["crowding"] >= 1.0
    alone = [w for w, _ in found["phases"]]  # 4, 16, 64, 256 products between two fences
    assert len(alone) == 4 and alone == sorted(alone) and alone[0] > 0
    assert all(together > 0 for _, together in found["phases"])
    for op in ("allreduce", "reduce_scatter", "allgather", "bcast", "sendrecv"):
        alpha, beta = found["fits"][op]
        assert alpha >= 0 and beta > 0  # bytes cost time


@pytest.mark.mpi
def test_calibrate_quick_measures_this_machine_into_the_cache(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    proc = run_xpnn(["calibrate", "--quick", "--models", "mlp", "--ranks", "2"], env=env)
    assert proc.returncode == 0, proc.stderr
    files = list((tmp_path / "xpnn" / "calibration").glob("*.json"))
    assert len(files) == 1
    machine = load(files[0])
    assert machine.comm["2"]["allreduce"][1] > 0
    assert all(v > 0 for v in machine.gemm.values()) and len(machine.gemm) >= 6
    plan = run_xpnn(["plan", "--model", "mlp", *TINY, "--json"], env=env)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)[0]["step_s"] > 0


@pytest.mark.mpi
def test_plan_measure_runs_the_best_the_middle_and_the_slowest_beside_their_predictions(tmp_path):
    cal = round_calibration(tmp_path / "cal.json")
    args = ["plan", "--model", "mlp", *TINY, "--calibration", str(cal), "--backend", "numpy"]
    proc = run_xpnn([*args, "--measure", "1", "--measure-steps", "4", "--json"])
    assert proc.returncode == 0, proc.stderr
    plans = json.loads(proc.stdout)
    measured = [i for i, p in enumerate(plans) if "measured_step_s" in p]
    assert measured == sorted({0, len(plans) // 2, len(plans) - 1})
    assert all(plans[i]["measured_step_s"] > 0 for i in measured)


def test_plan_for_several_nodes_prices_the_network_between_them(tmp_path):
    """``--nodes 2``: each node's ranks, and the node's sum across the network: measured in
    the calibration, else a stated default said on stderr."""
    cal = round_calibration(tmp_path / "cal.json")
    data = json.loads(cal.read_text())
    data["network"] = {"alpha": 1e-5, "beta": 1e-9}
    cal.write_text(json.dumps(data))
    proc = run_xpnn(["plan", "--model", "mlp", *TINY, "--calibration", str(cal), "--nodes", "2",
                     "--json"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "network" not in proc.stderr
    plans = json.loads(proc.stdout)
    assert plans and all(p["layout"]["nodes"] == 2 for p in plans)
    one_a_node = next(
        p
        for p in plans
        if p["layout"]["ranks"] == 2
        and p["layout"]["batch_threads"] == 1
        and p["layout"]["parallel"] == "data"
    )
    params = 784 * 32 + 32 + 32 * 10 + 10  # one bucket, one rank a node: no fence waits
    ring = 2 * (2 - 1) * 1e-5 + 2 * (2 - 1) / 2 * 4 * params * 1e-9
    assert one_a_node["comm_exposed"] + one_a_node["comm_hidden"] == pytest.approx(ring)
    del data["network"]
    cal.write_text(json.dumps(data))
    table = run_xpnn(["plan", "--model", "mlp", *TINY, "--calibration", str(cal), "--nodes", "4"])
    assert table.returncode == 0, table.stderr
    assert len(table.stderr.strip().splitlines()) == 1 and "10 Gb/s" in table.stderr
    assert "4 nodes x 2 cores" in table.stdout and "-ppn" in table.stdout
    wrong = run_xpnn(["plan", "--calibration", str(cal), "--nodes", "2", "--measure", "1"])
    assert wrong.returncode == 2 and "--measure" in wrong.stderr
