"""The trainer as a library: its config, made from a ``RunSpec``, refuses what the command
line refuses, and a diverged run is an exception a program can catch."""

from __future__ import annotations

import re

import pytest

from xpnn.backends import get_backend
from xpnn.data import load_dataset
from xpnn.errors import UserError
from xpnn.nn import build_model
from xpnn.parallel.comm import SelfCommunicator
from xpnn.run import RunSpec, build_run, train_config
from xpnn.runtime import init_world
from xpnn.train import TrainConfig, Trainer, TrainingDiverged


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("batch_size", 0, "`batch_size`: must be at least 1, got 0"),  # was 1/0
        ("epochs", 1.5, "`epochs`: must be a whole number >= 1, got 1.5"),
        ("step_epochs", -2, "`step_epochs`: must be a whole number >= 1"),  # a decay each step
        ("warmup_epochs", -1.0, "`warmup_epochs`: must be a finite number >= 0"),
        ("lr", float("nan"), "`lr`: must be a finite number > 0, got nan"),
        ("parallel", "bogus", "`parallel` 'bogus': choose one of data, tensor"),
        ("optimizer", "lbfgs", "`optimizer` 'lbfgs': choose one of sgd, momentum"),  # KeyError
        ("lr_scaling", "square", "`lr_scaling` 'square': choose one of none, linear"),  # none
        ("resume", True, "`resume`: needs `checkpoint_dir`"),  # started afresh
    ],
)
def test_a_config_refuses_what_the_command_line_refuses(field, value, needle):
    with pytest.raises(UserError, match="^" + re.escape(needle)):
        train_config(RunSpec(**{field: value}))


def test_a_config_has_the_specs_defaults_filled():
    cfg = train_config(RunSpec(epochs=7, schedule="step"), replicas=2)
    assert (cfg.batch_size, cfg.step_epochs, cfg.min_lr, cfg.bucket_mb) == (128, 2, 0.0, 25.0)
    assert cfg.lr == RunSpec.lr and cfg.node_share == "auto" and cfg.optimizer == "adam"
    linear = train_config(RunSpec(lr_scaling="linear", per_rank_batch=10), replicas=4)
    assert (linear.lr, linear.batch_size) == (4 * RunSpec.lr, 40)


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
            finished.append(_trainer(train_config(RunSpec(epochs=2, batch_size=50, lr=lr))).run())
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
