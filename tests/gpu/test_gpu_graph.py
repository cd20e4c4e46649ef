"""The training step as a CUDA graph on CuPy (``--cuda-graph``): the replayed step trains
exactly as the eager one (MLP and CNN, 1 and 2 ranks; clipping by the global norm), a partial
last batch runs eagerly and says so once, and ``CupyBackend.capture`` records, replays and
refuses a host wait.

Skipped, with the reason, where CuPy or a CUDA device is missing (as in CI); the same code's
CPU side is tested in tests/train/test_graph_step.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import cupy_or_skip, run_xpnn

pytestmark = pytest.mark.gpu

cupy = cupy_or_skip()

from xpnn.backends import get_backend  # noqa: E402
from xpnn.backends.common import CaptureFailed, StepScalars  # noqa: E402

# 1,280 samples in batches of 128: 10 full batches an epoch, no partial one
RUN = ["--backend", "cupy", "--dataset", "synthetic", "--epochs", "2", "--no-progress"]
RUN += ["--batch-size", "128", "--comm", "mpi-host"]


def _train(tmp_path, name: str, args: list[str], ranks: int) -> tuple[dict, str]:
    metrics, save = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.npz"
    proc = run_xpnn([*RUN, *args, "--metrics", str(metrics), "--save", str(save)], ranks)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    done = json.loads(metrics.read_text().splitlines()[-1])
    assert done["event"] == "done"
    return done, proc.stdout


def _same_params(tmp_path, a: str, b: str) -> None:
    with np.load(tmp_path / f"{a}.npz") as x, np.load(tmp_path / f"{b}.npz") as y:
        assert sorted(x.files) == sorted(y.files)
        for name in x.files:
            diff = float(np.max(np.abs(x[name] - y[name]), initial=0.0))
            assert np.array_equal(x[name], y[name]), f"{name}: largest difference {diff:.3g}"


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize(
    ("model", "size"),
    [("mlp", 1280), ("cnn", 1280)],  # the CNN's dropout keys come from the device too
)
def test_the_replayed_step_trains_exactly_as_the_eager_one(tmp_path, model, size, ranks):
    args = ["--model", model, "--synthetic-size", str(size)]
    eager, _ = _train(tmp_path, "eager", [*args, "--cuda-graph", "off"], ranks)
    graph, out = _train(tmp_path, "graph", [*args, "--cuda-graph", "on"], ranks)
    assert "graph_steps" not in eager
    assert graph["graph_steps"] == 2 * (size // 128) - 1  # the first step eager, once
    assert "cuda graph:" not in out  # no fallback: every batch is full
    assert graph["test_loss"] == eager["test_loss"]
    _same_params(tmp_path, "graph", "eager")


@pytest.mark.parametrize("ranks", [1, 2])
def test_clipping_by_the_global_norm_stays_on_the_device(tmp_path, ranks):
    args = ["--model", "mlp", "--synthetic-size", "1280", "--clip-norm", "0.05"]
    eager, _ = _train(tmp_path, "eager", [*args, "--cuda-graph", "off"], ranks)
    graph, _ = _train(tmp_path, "graph", [*args, "--cuda-graph", "on"], ranks)
    assert graph["graph_steps"] == 19
    norms = {}
    for name in ("eager", "graph"):  # each epoch's last step's norm, a replayed one's too
        lines = (tmp_path / f"{name}.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        norms[name] = [r["grad_norm"] for r in records if r["event"] == "epoch"]
    assert len(norms["graph"]) == 2 and norms["graph"] == norms["eager"]
    _same_params(tmp_path, "graph", "eager")


def test_a_partial_last_batch_runs_eagerly_and_says_so_once(tmp_path):
    args = ["--model", "mlp", "--synthetic-size", "1300", "--optimizer", "adamw"]
    eager, _ = _train(tmp_path, "eager", [*args, "--cuda-graph", "off"], 1)
    graph, out = _train(tmp_path, "graph", [*args, "--cuda-graph", "auto"], 1)
    said = [line for line in out.splitlines() if line.startswith("cuda graph:")]
    assert said == [
        "cuda graph: a batch of 20 samples, not the 128 recorded: such steps run eagerly"
    ]
    assert graph["graph_steps"] == 2 * 10 - 1
    _same_params(tmp_path, "graph", "eager")


def test_capture_records_once_and_replays_with_new_step_values():
    backend = get_backend("cupy", "float32")
    scalars = StepScalars(backend)
    rate = scalars.add(np.float32, lambda step: 0.5 * step)
    x = cupy.arange(4, dtype=cupy.float32)
    y = cupy.zeros_like(x)
    calls = []

    def fn():
        calls.append(1)
        y[...] = y + x * rate

    replay = backend.capture(fn)
    assert calls == [1] and float(y.sum()) == 0.0  # recorded, not run
    for step in (1, 2, 3):
        scalars.refresh(step)
        replay()
    assert calls == [1]  # the Python ran once
    np.testing.assert_array_equal(cupy.asnumpy(y), np.arange(4) * (0.5 + 1.0 + 1.5))


def test_a_host_wait_inside_fails_the_recording_and_leaves_the_stream_usable():
    backend = get_backend("cupy", "float32")
    x = cupy.ones(8, dtype=cupy.float32)
    with pytest.raises(CaptureFailed):
        backend.capture(lambda: float(x.sum()))  # a device-to-host copy waits
    assert float((x * 2).sum()) == 16.0


def test_the_gpt_recipe_replays_as_eager(tmp_path):
    """Text windows into the static positions buffer, attention, AdamW, --clip-norm 1."""
    from parallel.model.test_gpt_parallel import write_text

    corpus = write_text(tmp_path / "corpus.txt")
    args = ["--model", "gpt", "--dataset", "text", "--data-dir", corpus, "--layers", "2"]
    args += ["--heads", "2", "--embed", "16", "--block", "8", "--steps", "12", "--synthetic-size"]
    args += ["1280"]  # ignored by text: keeps RUN's flags valid
    eager, _ = _train(tmp_path, "eager", [*args, "--cuda-graph", "off"], 1)
    graph, out = _train(tmp_path, "graph", [*args, "--cuda-graph", "on"], 1)
    assert graph["graph_steps"] == 11 and "cuda graph:" not in out
    _same_params(tmp_path, "graph", "eager")
