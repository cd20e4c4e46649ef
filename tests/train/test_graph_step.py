"""The replayable training step (``cuda_graph``) on the CPU: the same code as on CuPy, with a
stand-in for the recording that runs the recorded function again at every replay while the
host's numbers of the step are poisoned, so a replay that read them (not the device values it
must read) would train differently. It trains exactly as the eager step does."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, mpiexec_path
from graph_standin import standin

from xpnn.backends import get_backend
from xpnn.backends.common import CaptureFailed, StepScalars, dropout_base_key, step_key
from xpnn.data import load_dataset
from xpnn.errors import UserError
from xpnn.nn import build_model
from xpnn.parallel.comm import SelfCommunicator
from xpnn.run import RunSpec, train_config
from xpnn.train import Trainer
from xpnn.train.graph import GraphStep, graph_unavailable


def _trainer(model: str, dtype: str = "float32", size: int | None = None, **cfg) -> Trainer:
    backend = get_backend("numpy", dtype)
    data = load_dataset("synthetic", synthetic_size=size or (230 if model == "mlp" else 70))
    net = build_model(model, (16, 8)) if model == "mlp" else build_model("cnn")
    if model == "cnn":  # a small CNN: the default one's 690,590 parameters take long here
        from xpnn.nn.models import cnn

        net = cnn(channels=(4, 8), dense=(16,), dropout=0.5)
    net.build(data.input_shape, backend, 0)
    config = train_config(RunSpec(**{"epochs": 2, "batch_size": 32, "cuda_graph": "off", **cfg}))
    return Trainer(net, data, backend, SelfCommunicator(), config, log=lambda line: None)


def _params(trainer: Trainer) -> np.ndarray:
    return np.array(trainer.model.params, copy=True)


@pytest.mark.parametrize(
    ("model", "optimizer", "extra"),
    [
        ("mlp", "adam", {}),
        ("mlp", "adamw", {"weight_decay": 0.1}),
        ("mlp", "momentum", {"schedule": "cosine", "warmup_steps": 3}),
        ("mlp", "sgd", {}),
        ("mlp", "adam", {"clip_norm": 0.05}),  # the norm and the factor on the device
        ("mlp", "momentum", {"clip_norm": 100.0}),  # within the norm: a factor of 1
        ("cnn", "adam", {}),  # dropout: its keys come from the device as well
    ],
)
def test_the_replayed_step_trains_exactly_as_the_eager_one(model, optimizer, extra):
    eager = _trainer(model, optimizer=optimizer, **extra)
    done_eager = eager.run()
    graphed = _trainer(model, optimizer=optimizer, **extra)
    calls: list[str] = []
    graphed.graph = GraphStep(graphed, standin(graphed, calls))
    lines: list[str] = []
    graphed.log = lines.append
    done = graphed.run()
    np.testing.assert_array_equal(_params(graphed), _params(eager))
    assert done["test_loss"] == done_eager["test_loss"]
    assert done["steps"] == done_eager["steps"] == graphed.optimizer.step_count
    if "clip_norm" in extra:  # the last step's norm, read from the device for the record
        assert float(graphed.optimizer.grad_norm) == eager.optimizer.grad_norm
    # 230 or 70 samples in batches of 32: 7 or 2 full batches and a partial one an epoch;
    # the first full one eager, once recorded, the other full ones replayed
    full = (230 // 32 if model == "mlp" else 70 // 32) * 2
    assert calls.count("captured") == 1
    assert done["graph_steps"] == calls.count("replayed") == full - 1
    said = [line for line in lines if line.startswith("cuda graph:")]
    assert said == ["cuda graph: a batch of 6 samples, not the 32 recorded: such steps run eagerly"]


def test_a_failed_recording_runs_that_step_and_the_rest_eagerly():
    eager = _trainer("mlp")
    eager.run()
    graphed = _trainer("mlp")

    def refuse(fn):
        raise CaptureFailed("RuntimeError: a wait for the device")

    graphed.graph = GraphStep(graphed, refuse)
    lines: list[str] = []
    graphed.log = lines.append
    done = graphed.run()
    np.testing.assert_array_equal(_params(graphed), _params(eager))
    assert done["graph_steps"] == 0
    assert [line for line in lines if "cuda graph" in line] == [
        "cuda graph: recording the step failed (RuntimeError: a wait for the device); eager"
    ]


def test_step_scalars_are_device_views_filled_at_each_refresh():
    backend = get_backend("numpy", "float32")
    scalars = StepScalars(backend)
    twice = scalars.add(np.float32, lambda step: 2.0 * step)
    key = step_key(7, scalars.step, 3)
    assert step_key(7, scalars.step, 3) is key  # one device value per (seed, salt)
    scalars.refresh(5)
    assert twice.shape == () and twice.dtype == np.float32 and float(twice) == 10.0
    assert int(key) == dropout_base_key(7, 5, 3) and key.dtype == np.uint32
    scalars.refresh(6)  # the same arrays, new values: what a replay reads
    assert float(twice) == 12.0 and int(key) == dropout_base_key(7, 6, 3)
    assert step_key(7, 6, 3) == dropout_base_key(7, 6, 3)  # a host step: the number


def test_the_cpu_backends_offer_no_recording():
    for name in ("numpy", "numba"):
        backend = get_backend(name)
        assert "graphs: backend cupy" in backend.capture_unavailable()
        with pytest.raises(NotImplementedError):
            backend.capture(lambda: None)


@pytest.mark.parametrize(
    ("cfg", "reason"),
    [
        ({}, "backend numpy runs each operation as it is called"),
        ({"accumulate": 2}, "`accumulate` above 1"),
        ({"precision": "fp16"}, "`precision` fp16: graphs record fp32 steps only"),
    ],
)
def test_auto_is_off_where_graphs_do_not_apply_and_on_refuses(cfg, reason, monkeypatch):
    if cfg:  # past the backend's own reason: a backend that records
        monkeypatch.setattr(type(get_backend("numpy")), "capture_unavailable", lambda self: None)
    quiet = _trainer("mlp", **cfg, cuda_graph="auto")
    assert quiet.graph is None
    assert reason in graph_unavailable(quiet)
    with pytest.raises(UserError, match="^`cuda_graph` on: " + reason.replace("(", r"\(")):
        _trainer("mlp", **cfg, cuda_graph="on")


def test_the_config_refuses_an_unknown_mode():
    with pytest.raises(UserError, match="^`cuda_graph` 'yes': choose one of auto"):
        train_config(RunSpec(cuda_graph="yes"))


def test_the_command_line_refuses_on_where_it_cannot_apply(tmp_path):
    args = ["--dataset", "synthetic", "--synthetic-size", "200", "--epochs", "1"]
    args += ["--backend", "numpy", "--no-progress", "--cuda-graph", "on"]
    proc = subprocess.run(
        [sys.executable, "-m", "xpnn", *args], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith("xpnn: --cuda-graph on: backend numpy"), lines[0]


def test_the_command_line_says_nothing_of_graphs_where_auto_is_off(tmp_path):
    metrics = tmp_path / "m.jsonl"
    args = ["--dataset", "synthetic", "--synthetic-size", "200", "--epochs", "1"]
    args += ["--backend", "numpy", "--no-progress", "--metrics", str(metrics)]
    proc = subprocess.run(
        [sys.executable, "-m", "xpnn", *args], capture_output=True, text=True, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert "graph" not in proc.stdout + proc.stderr
    done = json.loads(metrics.read_text().splitlines()[-1])
    assert done["event"] == "done" and "graph_steps" not in done


TWO_RANKS = """
import json, os, sys
sys.path.insert(0, sys.argv[3])
from graph_standin import standin
from xpnn.run import RunSpec, run
from xpnn.train.callbacks import Callback
from xpnn.train.graph import GraphStep

class Graphed(Callback):
    def on_train_begin(self, trainer):
        trainer.graph = GraphStep(trainer, standin(trainer, []))

spec = RunSpec(
    backend="numpy", comm="mpi-host", dataset="synthetic", synthetic_size=230, epochs=2,
    batch_size=32, hidden=(16, 8), optimizer="adamw", save=sys.argv[2], progress=False,
    clip_norm=float(sys.argv[4]) if sys.argv[4] != "none" else None,
)
done = run(spec, callbacks=[Graphed()] if sys.argv[1] == "graph" else [], log=lambda line: None)
if os.environ.get("PMI_RANK", "0") == "0":  # one line, not two interleaved
    print("DONE " + json.dumps({"update": done["update"], "graph_steps": done.get("graph_steps")}))
"""


@pytest.mark.parametrize("clip", ["none", "0.05"])  # clipping: in the update's recording
def test_two_replicas_exchange_between_the_replays_and_train_as_eager(tmp_path, clip):
    """Forward and backward replayed, the buckets allreduced between, the update replayed:
    the same parameters as the eager step's, whose buckets go out during backward."""
    script = tmp_path / "two.py"
    script.write_text(TWO_RANKS)
    said = {}
    for mode in ("eager", "graph"):
        out = tmp_path / f"{mode}.npz"
        cmd = [mpiexec_path(), "-n", "2", sys.executable, str(script), mode, str(out)]
        cmd += [str(ROOT / "tests" / "train"), clip]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=240)
        assert proc.returncode == 0, proc.stderr + proc.stdout
        lines = [line for line in proc.stdout.splitlines() if line.startswith("DONE")]
        said[mode] = json.loads(lines[0].removeprefix("DONE "))
    assert said["eager"] == {"update": "allreduce", "graph_steps": None}
    # 230 samples in batches of 32: 7 full ones an epoch, 14 in all, the first eager
    assert said["graph"] == {"update": "allreduce", "graph_steps": 13}
    with np.load(tmp_path / "eager.npz") as eager, np.load(tmp_path / "graph.npz") as graph:
        assert sorted(eager.files) == sorted(graph.files)
        for name in eager.files:
            np.testing.assert_array_equal(graph[name], eager[name], err_msg=name)


def test_a_kernels_scalar_is_converted_unless_it_is_a_device_value():
    from xpnn.backends.common import host_or_device

    f32 = np.dtype(np.float32)
    for number in (0.5, 2, np.float64(0.25), np.uint32(3)):  # numbers, NumPy's scalars
        got = host_or_device(f32, number)
        assert type(got) is np.float32 and got == number
    device = np.zeros((), np.float32)  # a 0-d array stands for a device value
    assert host_or_device(f32, device) is device


def test_a_replayed_steps_norm_is_read_from_the_device_for_the_record():
    """224 samples, batches of 32: every step after the first replayed, the last one too."""
    eager = _trainer("mlp", size=224, clip_norm=0.05)
    eager.run()
    graphed = _trainer("mlp", size=224, clip_norm=0.05)
    graphed.graph = GraphStep(graphed, standin(graphed, []))
    done = graphed.run()
    assert done["graph_steps"] == 13
    assert type(graphed.optimizer.grad_norm) is not float  # the device value (NumPy's here)
    assert float(graphed.optimizer.grad_norm) == eager.optimizer.grad_norm > 0.05
    np.testing.assert_array_equal(_params(graphed), _params(eager))


def test_the_gpt_recipe_on_text_windows_replays_as_eager(tmp_path):
    """Text: each step's windows drawn on the host into the static positions buffer; the
    recipe's AdamW and --clip-norm 1 inside the recording."""
    from parallel.model.test_gpt_parallel import write_text

    from xpnn.run import RunSpec, run
    from xpnn.train.callbacks import Callback

    class Graphed(Callback):
        def on_train_begin(self, trainer):
            trainer.graph = GraphStep(trainer, standin(trainer, []))

    corpus = write_text(tmp_path / "corpus.txt")
    said = {}
    for mode in ("eager", "graph"):
        spec = RunSpec(
            model="gpt", dataset="text", data_dir=corpus, layers=1, heads=2, embed=8, block=6,
            steps=6, batch_size=8, threads=1, progress=False, backend="numpy",
            save=str(tmp_path / f"{mode}.npz"),
        )  # fmt: skip
        said[mode] = run(spec, callbacks=[Graphed()] if mode == "graph" else [], log=print)
    assert said["graph"]["graph_steps"] == 5 and said["eager"].get("graph_steps") is None
    assert said["graph"]["preset"]["clip_norm"] == 1.0
    with np.load(tmp_path / "eager.npz") as eager, np.load(tmp_path / "graph.npz") as graph:
        for name in eager.files:
            np.testing.assert_array_equal(graph[name], eager[name], err_msg=name)
