"""``--model gpt`` without ``--batch-threads`` on a CPU backend: the planner's ``auto`` chooses
the batch threads (docs/gpt.md measured 2 batch threads at 1.33x 2 threads sharing each
product), said in the header and recorded in the metrics; given, or where batch threads cannot
run, the setting is left alone."""

import json

import pytest
from conftest import run_xpnn
from parallel.model.test_gpt_parallel import write_text

from xpnn.run import RunSpec
from xpnn.settings import gpt_preset

TINY = ["--model", "gpt", "--dataset", "text", "--layers", "1", "--heads", "2", "--embed", "8"]
TINY += ["--block", "6", "--steps", "2", "--no-progress", "--backend", "numpy"]


def test_a_gpt_on_a_cpu_backend_leaves_its_batch_threads_to_the_planner():
    spec, filled = gpt_preset(RunSpec(model="gpt", backend="numba"))
    assert spec.batch_threads == "auto" and "batch_threads" not in filled
    assert gpt_preset(RunSpec(model="gpt", backend="numpy", threads="auto"))[0].batch_threads == (
        "auto"
    )


@pytest.mark.parametrize(
    "chosen, given",
    [
        ({"batch_threads": 1}, {"batch_threads"}),  # typed, even as the default
        ({"batch_threads": 2}, None),
        ({"threads": 1}, None),  # one thread: nothing to split
        ({"backend": "torch"}, None),  # batch threads run on the CPU backends only
        ({"parallel": "tensor"}, None),
        ({"precision": "bf16"}, None),
        ({"dataset": "synthetic"}, None),  # the run's own check says a GPT needs text
        ({"heads": 3}, None),  # nor do 3 heads divide the embedding of 128
    ],
)
def test_batch_threads_are_left_alone_where_given_or_unable_to_run(chosen, given):
    spec = RunSpec(model="gpt", **{"backend": "numba", **chosen})
    assert gpt_preset(spec, given)[0].batch_threads == chosen.get("batch_threads", 1)
    assert gpt_preset(RunSpec(model="mlp", backend="numba"))[0].batch_threads == 1


def test_a_gpt_run_without_the_flag_records_the_batch_threads_auto_chose(tmp_path):
    corpus = write_text(tmp_path / "corpus.txt")
    metrics = tmp_path / "m.jsonl"
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}  # the calibration, measured here
    args = [*TINY, "--data-dir", corpus, "--metrics", str(metrics)]
    proc = run_xpnn([*args, "--threads", "2"], env=env)
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stdout.splitlines() if line.startswith("xpnn: auto: ")]
    assert len(said) == 1 and "predicted" in said[0], proc.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    chosen = records[0]["auto"]
    assert chosen["parallel"] == "data" and chosen["batch_threads"] in (1, 2)
    assert f"--batch-threads {chosen['batch_threads']} " in said[0]
    assert records[0]["plan"]["batch_threads"] == chosen["batch_threads"]
    assert "batch_threads" not in records[0]["preset"]  # auto's choice, not the recipe's
    given = run_xpnn([*args, "--threads", "2", "--batch-threads", "1"], env=env)
    assert given.returncode == 0, given.stderr
    assert "xpnn: auto: " not in given.stdout
    assert not [json.loads(line) for line in metrics.read_text().splitlines()][0].get("auto")
