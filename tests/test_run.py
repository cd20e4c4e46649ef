"""A run built in Python from a ``RunSpec`` (no command line), the trainer's callbacks, and
library messages that name parameters where the command line names flags."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from conftest import ROOT

from xpnn.errors import UserError
from xpnn.run import RunSpec, build_run, global_batch
from xpnn.runtime.world import init_world
from xpnn.train import Callback, MetricsFile, PhaseTimer
from xpnn.train.trainer import overrides

TINY = dict(
    dataset="synthetic", synthetic_size=192, hidden=(16,), epochs=2, batch_size=64, backend="numpy"
)
TINY |= dict(threads=1, progress=False, seed=3)


def _silent(line: str) -> None:
    pass


def test_a_run_spec_trains_without_the_command_line(tmp_path):
    metrics = tmp_path / "m.jsonl"
    spec = RunSpec(**TINY, metrics=str(metrics), save=str(tmp_path / "p.npz"))
    trainer = build_run(spec, init_world(), log=_silent)
    assert trainer.cfg.batch_size == 64 and trainer.steps_per_epoch == 3
    done = trainer.run()
    assert done["event"] == "done" and done["epochs"] == 2 and done["ranks_agree"]
    assert 0.0 <= done["test_acc"] <= 1.0 and done["params"] == 784 * 16 + 16 + 16 * 10 + 10
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [line["event"] for line in lines] == ["epoch", "epoch", "done"]
    assert (tmp_path / "p.npz").exists()


def test_the_same_spec_trains_the_same_run():
    """The spec is the whole run: two builds of it end on the same parameters."""
    digests = [
        build_run(RunSpec(**TINY), init_world(), log=_silent).run()["params_sha256"]
        for _ in range(2)
    ]
    assert digests[0] == digests[1]
    other = build_run(RunSpec(**{**TINY, "seed": 4}), init_world(), log=_silent).run()
    assert other["params_sha256"] != digests[0]


class _Recorder(Callback):
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def on_train_begin(self, trainer: Any) -> None:
        self.events.append(("train_begin",))

    def on_epoch_begin(self, trainer: Any, epoch: int) -> None:
        self.events.append(("epoch_begin", epoch))

    def on_step_begin(self, trainer: Any, step: int) -> None:
        self.events.append(("step_begin", step))

    def on_step_end(self, trainer: Any, step: int) -> None:
        self.events.append(("step_end", step))

    def on_epoch_end(self, trainer: Any, record: dict) -> None:
        self.events.append(("epoch_end", record["epoch"]))

    def on_train_end(self, trainer: Any, record: dict) -> None:
        self.events.append(("train_end", record["event"]))


def test_a_callback_sees_the_events_in_order():
    recorder = _Recorder()
    build_run(RunSpec(**TINY), init_world(), callbacks=[recorder], log=_silent).run()
    expected: list[tuple[Any, ...]] = [("train_begin",)]
    for epoch in range(2):
        expected.append(("epoch_begin", epoch))
        for step in range(3 * epoch, 3 * epoch + 3):
            expected += [("step_begin", step), ("step_end", step)]
        expected.append(("epoch_end", epoch + 1))
    assert recorder.events == [*expected, ("train_end", "done")]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow, on its way to inf
def test_a_diverged_run_ends_its_callbacks_with_the_diverged_line(tmp_path):
    from xpnn.train import TrainingDiverged

    recorder = _Recorder()
    spec = RunSpec(**{**TINY, "lr": 1e300}, metrics=str(tmp_path / "m.jsonl"))
    trainer = build_run(spec, init_world(), callbacks=[recorder], log=_silent)
    with pytest.raises(TrainingDiverged):
        trainer.run()
    assert recorder.events[-2:] == [("epoch_end", 1), ("train_end", "diverged")]
    last = json.loads((tmp_path / "m.jsonl").read_text().splitlines()[-1])
    assert last == {"event": "diverged", "epoch": 1}


def test_the_metrics_callback_writes_the_contracts_keys(tmp_path):
    """The metrics file's keys (docs/cli.md, "The metrics file") stay, whatever is added."""
    path = tmp_path / "m.jsonl"
    build_run(RunSpec(**TINY, metrics=str(path)), init_world(), log=_silent).run()
    epoch, _, done = (json.loads(line) for line in path.read_text().splitlines())
    common = {"world_size", "backend", "comm"}
    assert {"event", "epoch", "train_loss", "test_loss", "test_acc", "seconds"} <= epoch.keys()
    assert {"samples_per_s"} | common <= epoch.keys()
    assert {"event", "epochs", "test_acc", "test_loss", "total_seconds", "params"} <= done.keys()
    assert common <= done.keys()
    assert (epoch["event"], epoch["epoch"], done["event"]) == ("epoch", 1, "done")
    assert (epoch["world_size"], epoch["backend"], epoch["comm"]) == (1, "numpy", "self")


def test_a_metrics_file_alone_is_the_same_callback_as_the_spec_makes(tmp_path):
    """A program adds the metrics file as a callback of its own: the same lines come out."""
    by_spec, by_callback = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    build_run(RunSpec(**TINY, metrics=str(by_spec)), init_world(), log=_silent).run()
    cb = MetricsFile(str(by_callback))
    build_run(RunSpec(**TINY), init_world(), callbacks=[cb], log=_silent).run()
    timing = {"seconds", "samples_per_s", "total_seconds", "peak_rss_mb"}

    def lines(path: Any) -> list[dict]:
        return [
            {k: v for k, v in json.loads(line).items() if k not in timing}
            for line in path.read_text().splitlines()
        ]

    assert lines(by_spec) == lines(by_callback)


def test_callbacks_without_step_events_are_not_called_per_step():
    """The hot loop calls only the callbacks that act on steps: none in a plain run."""
    trainer = build_run(RunSpec(**TINY), init_world(), log=_silent)
    assert trainer._step_begin == [] and trainer._step_end == []
    assert not overrides(MetricsFile("x"), "on_step_end")
    assert overrides(PhaseTimer(), "on_step_begin") and overrides(_Recorder(), "on_step_end")


def test_the_phase_timer_times_every_step_and_its_phases():
    timer = PhaseTimer()
    build_run(RunSpec(**TINY), init_world(), callbacks=[timer], log=_silent).run()
    assert len(timer.steps) == 6
    for step in timer.steps:
        assert step["step"] > 0 and step["forward"] > 0 and step["wgrad"] > 0
        assert step["update"] > 0 and step["fences"] == 0.0  # one process: no fences
        assert step["forward"] + step["wgrad"] + step["update"] <= step["step"]


def test_fault_injection_is_a_callback_that_fails_its_step(monkeypatch):
    monkeypatch.setenv("XPNN_FAIL_AT", "0:4")
    recorder = _Recorder()
    trainer = build_run(RunSpec(**TINY), init_world(), callbacks=[recorder], log=_silent)
    with pytest.raises(RuntimeError, match="injected failure at step 4"):
        trainer.run()
    assert recorder.events[-1] == ("step_end", 3)  # step 4 never started


def test_a_library_error_names_the_parameter_and_the_command_line_its_flag(capsys):
    with pytest.raises(UserError) as caught:
        global_batch(RunSpec(batch_size="abc"), 1, 100)
    assert caught.value.param == "batch_size"
    assert str(caught.value) == "`batch_size`: expected a number or 'full', got 'abc'"
    # build_run raises it to a program, printing nothing: only the command line prints and exits
    with pytest.raises(UserError, match="`batch_size`: expected a number or 'full'"):
        build_run(RunSpec(**{**TINY, "batch_size": "abc"}), init_world(), log=_silent)
    assert capsys.readouterr().err == ""
    # the command line says the same with its flag, on one line, exit 2
    proc = subprocess.run(
        [sys.executable, "-m", "xpnn", "--dataset", "synthetic", "--batch-size", "abc"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr == "xpnn: --batch-size: expected a number or 'full', got 'abc'\n"


def test_every_parameter_a_message_names_is_a_flag():
    """The command line words each `name` of the library's messages as its flag: a name that
    is no flag would be printed as it is, which a command-line user cannot act on."""
    from dataclasses import fields

    from xpnn.commands.flags import FLAGS, flag_words
    from xpnn.errors import PARAM

    assert {f.name for f in fields(RunSpec)} <= FLAGS.keys()
    named = {n for path in (ROOT / "xpnn").rglob("*.py") for n in PARAM.findall(path.read_text())}
    assert {"batch_size", "comm", "data_dir", "checkpoint_dir"} <= named
    assert not {n for n in named if "`" in flag_words(f"`{n}`")}
    assert (
        flag_words("`model_ranks` 3 with `parallel` data") == "--model-ranks 3 with --parallel data"
    )
    assert flag_words("`progress`") == "--no-progress"


def test_run_failed_carries_the_one_line_reason():
    """The reason went to stderr only: a program catching RunFailed could not say it."""
    from xpnn.run import RunFailed, run

    with pytest.raises(RunFailed) as info:
        run(RunSpec(batch_size=0, backend="numpy"), log=_silent, warn=_silent)
    assert info.value.exit_code == 2
    assert info.value.reason == "`batch_size`: must be at least 1, got 0"
    assert str(info.value) == f"the run failed: {info.value.reason} (exit code 2)"
