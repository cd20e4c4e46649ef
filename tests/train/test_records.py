"""The metrics' records add up: the done record's steps, samples, tokens, seconds and rates
are those of the records before it."""

import json

import pytest
from parallel.model.test_gpt_parallel import write_text

from xpnn.run import RunSpec, build_run
from xpnn.runtime.world import init_world

BLOCK = 6


def _silent(_line: str) -> None:
    pass


def _records(tmp_path, **settings) -> list[dict]:
    corpus = write_text(tmp_path / "corpus.txt")  # 16,000 windows an epoch
    path = tmp_path / "m.jsonl"
    spec = RunSpec(
        model="gpt", dataset="text", data_dir=corpus, layers=1, heads=2, embed=8, block=BLOCK,
        batch_size=3000, threads=1, progress=False, metrics=str(path), **settings,
    )  # fmt: skip
    build_run(spec, init_world(), log=_silent).run()
    return [json.loads(line) for line in path.read_text().splitlines()]


def _agree(done: dict, spans: list[dict]) -> None:
    """``done`` from ``spans`` (the records of the run's spans of steps)."""
    seconds = sum(r["seconds"] for r in spans)
    samples = sum(r["samples_per_s"] * r["seconds"] for r in spans)
    assert done["total_seconds"] == pytest.approx(seconds, rel=1e-9)
    assert done["samples"] == pytest.approx(samples, rel=1e-9)
    assert done["tokens"] == done["samples"] * BLOCK
    assert done["samples_per_s"] == pytest.approx(samples / seconds, rel=1e-9)
    tokens = sum(r["tokens_per_s"] * r["seconds"] for r in spans)
    assert done["tokens_per_s"] == pytest.approx(tokens / seconds, rel=1e-9)
    assert done["epochs"] == spans[-1]["epoch"]
    assert (done["test_loss"], done["val_loss"]) == (spans[-1]["test_loss"], spans[-1]["val_loss"])


def test_a_run_by_steps_ends_with_the_sums_of_its_eval_records(tmp_path):
    """Across an epoch's end (6 steps an epoch, the last of 1,000 windows): steps, epochs'
    worth of batches, samples, tokens and rates of the done record are its eval records'."""
    records = _records(tmp_path, steps=9, eval_every=3, lr=1e-3)
    evals, done = records[:-1], records[-1]
    assert [r["event"] for r in evals] == ["eval"] * 3 and done["event"] == "done"
    assert [r["step"] for r in evals] == [3, 6, 9]
    assert done["steps"] + done.get("skipped_steps", 0) == evals[-1]["step"]
    assert done["epochs"] == 9 / 6
    assert done["samples"] == 5 * 3000 + 1000 + 3 * 3000
    _agree(done, evals)


def test_a_run_by_epochs_ends_with_the_sums_of_its_epoch_records(tmp_path):
    records = _records(tmp_path, epochs=2, lr=1e-3)
    epochs, done = records[:-1], records[-1]
    assert [r["epoch"] for r in epochs] == [1, 2] and done["epochs"] == 2
    assert done["steps"] == 2 * 6 and done["samples"] == 2 * 16000
    _agree(done, epochs)
