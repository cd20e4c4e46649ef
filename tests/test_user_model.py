"""A user's model written against ``xpnn.nn.Model``'s names alone (no Sequential, no layers)
trains through the command line on 1 rank and data-parallel on 2 (real mpiexec), to the same
parameters; the runner refuses one that lacks a name, naming it."""

import numpy as np
import pytest
from conftest import assert_one_line_user_error, run_xpnn, train_and_load

from xpnn.nn import Model
from xpnn.nn.models import BUILT, METHODS

SOFTMAX = '''
import numpy as np


class Softmax:
    """Softmax regression with only the Model protocol's names."""

    def __init__(self, features, classes):
        self.features, self.classes = features, classes

    def build(self, input_shape, backend, seed):
        self.backend = backend
        w = np.random.default_rng(seed).standard_normal(self.features * self.classes) * 0.01
        self.params = backend.asarray(np.concatenate([w, np.zeros(self.classes)]))
        self.grads = backend.xp.zeros_like(self.params)
        self.size = int(self.params.shape[0])
        self.layer_offsets = [0]  # backward reports nothing early: the update waits for all
        return self

    def adopt(self, params, grads, copy=True):
        if copy:
            params[...] = self.params
        self.params, self.grads = params, grads

    def named_views(self, flat):
        n, xp = self.features * self.classes, self.backend.xp
        return {"W": xp.reshape(flat[:n], (self.features, self.classes)), "b": flat[n:]}

    def _scores(self, x, labels):
        xp, v = self.backend.xp, self.named_views(self.params)
        x = xp.reshape(x, (x.shape[0], self.features))
        z = x @ v["W"] + v["b"]
        p = xp.exp(z - xp.max(z, axis=1, keepdims=True))
        p = p / xp.sum(p, axis=1, keepdims=True)
        rows = xp.arange(x.shape[0])
        loss = -xp.sum(xp.log(p[rows, labels]))
        correct = xp.sum(xp.argmax(z, axis=1) == labels)
        return x, p, rows, loss, correct

    def loss_and_grads(self, x, labels, ctx, scale, on_grads_ready=None):
        x, p, rows, loss, correct = self._scores(x, labels)
        p[rows, labels] -= 1.0
        dz = p * scale
        g = self.named_views(self.grads)
        g["W"][...] = x.T @ dz
        g["b"][...] = self.backend.xp.sum(dz, axis=0)
        return loss, correct

    def evaluate(self, x, labels):
        return self._scores(x, labels)[3:]

    def summary(self):
        return f"Softmax({self.features} -> {self.classes})  ({self.size:,} parameters)"


def build(input_shape, classes):
    return Softmax(int(np.prod(input_shape)), classes)


class NoEvaluate(Softmax):
    evaluate = None


def no_evaluate(input_shape, classes):
    return NoEvaluate(int(np.prod(input_shape)), classes)
'''

RUN = ["--dataset", "synthetic", "--synthetic-size", "96", "--batch-size", "24", "--epochs",
       "2", "--dtype", "float64", "--backend", "numpy", "--threads", "1", "--optimizer", "adam",
       "--lr", "0.01", "--no-progress"]  # fmt: skip


@pytest.fixture
def models(tmp_path):
    path = tmp_path / "softmax.py"
    path.write_text(SOFTMAX)
    return str(path)


def test_the_protocol_is_the_names_the_docs_list():
    """docs/model-api.md lists the protocol's names; a user's model implements those."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "model-api.md").read_text()
    section = text.split("## Your own model class", 1)[1].split("\n## ", 1)[0]
    for name in (*METHODS, *BUILT):
        assert f"`{name}" in section, name
    assert {*METHODS, *BUILT} <= set(Model.__annotations__) | set(vars(Model))


@pytest.mark.mpi
@pytest.mark.parametrize("comm", ["auto", "mpi-host"])
def test_a_protocol_model_trains_on_two_ranks_as_on_one(models, tmp_path, comm):
    """The Softmax above trains (its loss falls) and 2 data-parallel ranks, sharing a node's
    gradients (auto: mpi-shm, through ``adopt``) or each holding a copy (mpi-host), give 1
    rank's parameters."""
    args = [*RUN, "--model", f"{models}:build"]
    saved = {}
    for ranks in (1, 2):
        extra = ["--comm", comm] if ranks == 2 else []
        saved[ranks], records, proc = train_and_load(tmp_path, ranks, [*args, *extra])
        assert "Softmax(784 -> 10)  (7,850 parameters)" in proc.stdout
        epochs = [r for r in records if r["event"] == "epoch"]
        assert epochs[-1]["train_loss"] < 0.5 * epochs[0]["train_loss"], epochs
        assert records[-1]["params"] == 7850 and records[-1]["ranks_agree"]
    assert records[-1]["comm"] == ("mpi-shm" if comm == "auto" else comm)
    assert sorted(saved[1]) == ["W", "b"] and np.abs(saved[1]["b"]).min() > 0  # b began at 0
    for name, value in saved[1].items():
        np.testing.assert_allclose(saved[2][name], value, rtol=1e-9, atol=1e-12, err_msg=name)


def test_a_model_without_a_protocol_name_is_refused_naming_it(models):
    proc = run_xpnn([*RUN, "--model", f"{models}:no_evaluate"])
    assert_one_line_user_error(proc, "lacks evaluate")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--parallel", "pipeline"], "is not an xpnn.nn.Sequential of layers to split or stage"),
        (["--parallel", "tensor"], "is not an xpnn.nn.Sequential of layers to split or stage"),
        (["--precision", "bf16", "--dtype", "float32"], "run the layers of an xpnn.nn.Sequential"),
    ],
)
def test_what_needs_layers_refuses_a_protocol_model_naming_it(models, extra, message):
    """Strategies that split, stage or cast layers need a Sequential: one line, exit 2 (the
    last ``--dtype`` given is the one used)."""
    proc = run_xpnn([*RUN, "--model", f"{models}:build", *extra])
    assert_one_line_user_error(proc, message)
