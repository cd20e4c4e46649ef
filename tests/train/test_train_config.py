"""The trainer as a library: its config refuses what the command line refuses, and a
diverged run is an exception a program can catch."""

from __future__ import annotations

import pytest

from xpnn.backends import get_backend
from xpnn.data import load_dataset
from xpnn.errors import UserError
from xpnn.nn import build_model
from xpnn.parallel.comm import SelfCommunicator
from xpnn.run import RunSpec, build_run
from xpnn.runtime import init_world
from xpnn.train import TrainConfig, Trainer, TrainingDiverged


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("batch_size", 0, "TrainConfig.batch_size: must be an integer >= 1, got 0"),  # was 1/0
        ("eval_batch_size", -5, "TrainConfig.eval_batch_size"),  # was a test accuracy of 0
        ("epochs", 1.5, "TrainConfig.epochs"),
        ("step_epochs", -2, "TrainConfig.step_epochs"),  # the rate decayed every step
        ("warmup_epochs", -1.0, "TrainConfig.warmup_epochs: must be >= 0"),
        ("lr", float("nan"), "TrainConfig.lr: must be finite and > 0"),
        ("parallel", "bogus", "TrainConfig.parallel: 'bogus', choose one of data, tensor"),
        ("resume", True, "TrainConfig.resume: needs a checkpoint_dir"),  # started afresh
    ],
)
def test_a_config_refuses_what_the_command_line_refuses(field, value, needle):
    with pytest.raises(ValueError, match="^" + needle.replace("(", r"\(")):
        TrainConfig(**{field: value})


def _trainer(cfg: TrainConfig) -> Trainer:
    backend = get_backend("numpy", "float64")
    data = load_dataset("synthetic", synthetic_size=200)
    model = build_model("mlp", (8,)).build(data.input_shape, backend, cfg.seed)
    return Trainer(model, data, backend, SelfCommunicator(), cfg, log=lambda line: None)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the overflow, on its way to inf
def test_a_diverged_run_is_an_exception_a_sweep_can_catch():
    """An exception, not a SystemExit: ``except Exception`` in a learning-rate sweep catches
    it, and the program goes on to the next rate."""
    finished = []
    for lr in (1e300, 1e-3):
        try:
            finished.append(_trainer(TrainConfig(epochs=2, batch_size=50, lr=lr)).run())
        except TrainingDiverged as exc:
            assert exc.epoch == 1 and str(exc).startswith("training diverged in epoch 1")
    assert len(finished) == 1 and finished[0]["epochs"] == 2
    assert issubclass(TrainingDiverged, Exception)


def test_a_new_run_refuses_a_directory_of_another_runs_checkpoints(tmp_path):
    """Through the library a second run overwrote the first one's epochs 1-2 while its epoch 3
    stayed, and a later resume continued the first run. The command line refused it."""
    tiny = {"dataset": "synthetic", "synthetic_size": 200, "hidden": (8,), "batch_size": 50}
    tiny |= {"dtype": "float64", "progress": False, "checkpoint_dir": str(tmp_path)}
    world, silent = init_world(), lambda line: None
    build_run(RunSpec(**tiny, epochs=2), world, log=silent).run()
    with pytest.raises(UserError, match="holds another run's checkpoints"):
        build_run(RunSpec(**tiny, epochs=2), world, log=silent)
    resumed = build_run(RunSpec(**tiny, epochs=3, resume=True), world, log=silent)
    assert resumed.run()["epochs"] == 3
