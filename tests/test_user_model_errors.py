"""The command line on a user's model that does not fit the data, a layer of theirs that fails
or returns a wrong shape (1 and 2 ranks, a pipeline), and a model file that exits at import:
one line naming --model, a non-zero exit, never a traceback."""

import pytest
from conftest import assert_one_line_user_error, run_xpnn

RUN = ["--dataset", "synthetic", "--synthetic-size", "96", "--batch-size", "24", "--epochs", "1",
       "--backend", "numpy", "--threads", "1", "--no-progress"]  # fmt: skip
MODELS = """
import os, sys
from xpnn.nn import Dense, Flatten, Layer, Sequential
from xpnn.nn.conv import Conv2D

if os.environ.get("EXIT_AT_IMPORT", "no") in (os.environ.get("PMI_RANK", "0"), "any"):
    sys.exit(0)


class MyLayer(Layer):
    def setup(self, in_shape, rng):
        self.add_param("s", 1.0, in_shape)
        return in_shape

    def forward(self, x, ctx):
        self.x = x
        return x * self.params["s"]

    def backward(self, dy, need_dx=True):
        self.grads["s"][...] = self.xp.sum(dy * self.x, axis=0)
        return (dy * self.params["s"])[:1]  # broadcasts: trained on, silently wrong


def dense3(shape, classes):
    return Sequential([Flatten(), Dense(3)])


def no_flatten(shape, classes):
    return Sequential([Dense(classes)])


def empty(shape, classes):
    return Sequential([])


def kernel50(shape, classes):
    return Sequential([Conv2D(2, 50), Flatten(), Dense(classes)])


def mine(shape, classes):
    return Sequential([Flatten(), Dense(5), Dense(5), MyLayer(), Dense(classes)])
"""


@pytest.fixture
def models(tmp_path):
    path = tmp_path / "models.py"
    path.write_text(MODELS)
    return str(path)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("dense3", "gives outputs of shape (3,) a sample; the data needs (10,)"),
        ("no_flatten", "gives outputs of shape (1, 28, 10) a sample"),
        ("empty", "has no layers"),
        ("kernel50", "ValueError: Conv2D kernel 50x50 larger than input"),
    ],
)
def test_a_model_that_does_not_fit_the_data_names_model(models, name, message):
    proc = run_xpnn([*RUN, "--model", f"{models}:{name}"])
    assert_one_line_user_error(proc, f"--model {models}:{name}: {message}")


@pytest.mark.parametrize(
    ("ranks", "extra", "layer"),
    [(1, [], 3), (2, [], 3), (2, ["--parallel", "pipeline"], 3)],
    ids=["one-rank", "two-ranks", "pipeline"],
)
def test_a_backward_of_the_wrong_shape_is_refused_naming_the_layer(models, ranks, extra, layer):
    proc = run_xpnn([*RUN, "--model", f"{models}:mine", *extra], ranks=ranks, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"--model layer {layer} (MyLayer) backward returned shape (1, 5)" in proc.stderr
    assert "XPNN_DEBUG=1" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(("ranks", "exit_at"), [(1, "any"), (2, "1")])
def test_a_model_file_that_exits_at_import_is_one_line(models, ranks, exit_at):
    args = [*RUN, "--model", f"{models}:mine"]
    proc = run_xpnn(args, ranks=ranks, timeout=120, env={"EXIT_AT_IMPORT": exit_at})
    assert proc.returncode != 0
    assert "importing it called sys.exit(0)" in proc.stderr
    assert "Traceback" not in proc.stderr and "TypeError" not in proc.stderr
