"""``--parallel auto``, ``--threads auto`` and ``--batch-threads auto``: the layout chosen
once by rank 0 for every rank, said in the header with the flags that repeat it, recorded in
the metrics and the checkpoints, and kept by a resume whatever the machine's load then."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_xpnn
from tests.planner.test_cost_model import RoundMachine
from xpnn.planner import auto
from xpnn.run import RunSpec, resolve

TINY = ["--dataset", "synthetic", "--synthetic-size", "256", "--batch-size", "64", "--hidden", "32"]
TINY += ["--backend", "numpy", "--no-progress", "--dtype", "float64"]


def test_the_cores_free_are_the_cores_less_the_other_runnable_threads():
    assert auto.free_cores(8, None) == 8  # unknown: all of them
    assert auto.free_cores(8, 1) == 8  # only this process runs
    assert auto.free_cores(8, 5) == 4
    assert auto.free_cores(2, 14) == 1  # never none
    assert auto.free_cores(2, 0) == 2


def test_the_candidates_hold_what_was_given_and_vary_what_is_auto():
    spec, _ = resolve(RunSpec(threads="auto", batch_threads="auto"))
    options = auto.candidates(spec, ranks=1, cores=2)
    assert {(o["threads"], o["batch_threads"]) for o in options} == {(2, 1), (2, 2), (1, 1)}
    assert all(o["parallel"] == "data" for o in options)  # one rank splits nothing
    spec, _ = resolve(RunSpec(parallel="auto", threads=1))
    options = auto.candidates(spec, ranks=2, cores=1)
    assert [o["parallel"] for o in options] == ["data", "tensor", "pipeline"]


def test_the_choice_is_the_predicted_fastest_and_refuses_nothing_valid():
    spec, _ = resolve(RunSpec(hidden=(32,), parallel="auto", threads="auto", batch_threads="auto"))
    chosen, pred = auto.choose(spec, ranks=2, cores=1, machine=RoundMachine(cores=2))
    from xpnn.planner.cost import Layout, predict
    from xpnn.planner.work import work_of

    work = work_of(spec)
    steps = [
        predict(RoundMachine(2), work, Layout(2, o["threads"], o["parallel"],
                o["batch_threads"], microbatches=4, comm="auto"), 128).step
        for o in auto.candidates(spec, 2, 1)
    ]  # fmt: skip
    assert pred.step == pytest.approx(min(steps))  # every candidate of this model is valid
    assert chosen["parallel"] in auto.MODES


@pytest.mark.mpi
def test_auto_on_two_ranks_is_said_recorded_and_kept_by_a_resume(tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    args = [*TINY, "--parallel", "auto", "--threads", "auto", "--batch-threads", "auto"]
    args += ["--checkpoint-dir", str(ck), "--metrics", str(metrics), "--seed", "3"]
    first = run_xpnn([*args, "--epochs", "1"], ranks=2)
    assert first.returncode == 0, first.stderr
    said = [line for line in first.stdout.splitlines() if line.startswith("xpnn: auto: ")]
    assert len(said) == 1 and "these flags repeat it" in said[0]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    chosen = records[0]["auto"]
    assert set(chosen) == {"parallel", "threads", "batch_threads"}
    assert f"--parallel {chosen['parallel']} --threads {chosen['threads']}" in said[0]
    assert records[0]["plan"]["mode"] == chosen["parallel"]
    assert records[0]["plan"]["batch_threads"] == chosen["batch_threads"]
    resumed = run_xpnn([*args, "--epochs", "2", "--resume"], ranks=2)
    assert resumed.returncode == 0, resumed.stderr
    assert "xpnn: auto: kept from the checkpoint: " in resumed.stdout
    again = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["auto"] for r in again if r.get("event") == "epoch"] == [chosen, chosen]


def test_a_stored_choice_is_read_back_from_the_latest_checkpoint(tmp_path):
    args = [*TINY, "--threads", "auto", "--epochs", "1", "--checkpoint-dir", str(tmp_path)]
    proc = run_xpnn(args)
    assert proc.returncode == 0, proc.stderr
    kept = auto.stored_choice(str(tmp_path))
    assert kept is not None and kept["parallel"] == "data" and kept["batch_threads"] == 1
    assert auto.stored_choice(str(tmp_path / "none")) is None


def test_auto_is_refused_in_one_line_where_no_layout_fits():
    proc = run_xpnn([*TINY, "--threads", "two"])
    assert proc.returncode == 2 and "--threads" in proc.stderr
    proc = run_xpnn([*TINY, "--parallel", "auto", "--batch-threads", "2", "--precision", "bf16"])
    assert proc.returncode == 2, proc.stdout
    assert proc.stderr.strip() == "xpnn: --parallel auto: no layout fits these settings"
