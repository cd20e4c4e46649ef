"""Every model preset (MLP, CNN, GPT) and a user's model trains through the command line on
every CPU backend installed, each to NumPy's parameters in float64. The GPT on ``torch``
failed in the trainer: the text windows were taken with 2-D indices, which the array API (and
PyTorch's ``take``) refuses."""

import importlib.util

import numpy as np
import pytest
from conftest import train_and_load

COMMON = ["--dtype", "float64", "--threads", "1", "--no-progress", "--lr", "0.01"]
SYNTHETIC = ["--dataset", "synthetic", "--synthetic-size", "40", "--batch-size", "8"]
USER_MODEL = """
from xpnn.nn import GELU, Dense, Flatten, Layer, LayerNorm, Residual, Sequential


class Scale(Layer):
    def setup(self, in_shape, rng):
        self.add_param("s", 1.0, in_shape)
        return in_shape

    def forward(self, x, ctx):
        self.x = x
        return x * self.params["s"]

    def backward(self, dy, need_dx=True):
        self.grads["s"][...] = self.xp.sum(dy * self.x, axis=0)
        return dy * self.params["s"] if need_dx else None


def build(input_shape, num_classes):
    layers = [Flatten(), Dense(12), Residual([LayerNorm(), Dense(12), GELU()]), Scale()]
    return Sequential([*layers, Dense(num_classes)])
"""
BACKENDS = ["numba", "torch"]


def _args(model: str, tmp_path) -> list[str]:
    if model == "gpt":
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("to be or not to be, that is the question. " * 40)
        shape = ["--layers", "1", "--heads", "2", "--embed", "8", "--block", "6"]
        return ["--model", "gpt", "--dataset", "text", "--data-dir", str(corpus), *shape,
                "--batch-size", "8", "--steps", "3", "--warmup-steps", "0"]  # fmt: skip
    if model == "user":
        path = tmp_path / "mine.py"
        path.write_text(USER_MODEL)
        return ["--model", f"{path}:build", *SYNTHETIC, "--steps", "3"]
    if model == "cnn":
        return ["--model", "cnn", *SYNTHETIC, "--steps", "2"]
    return ["--hidden", "12,8", *SYNTHETIC, "--epochs", "1"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", ["mlp", "cnn", "gpt", "user"])
def test_each_model_on_each_backend_equals_numpy(tmp_path, model, backend):
    if backend == "torch" and not all(
        importlib.util.find_spec(m) for m in ("torch", "array_api_compat")
    ):
        pytest.skip("PyTorch is not installed (pip install 'xpnn[torch]')")
    args = [*_args(model, tmp_path), *COMMON]
    want, _, _ = train_and_load(tmp_path, 1, [*args, "--backend", "numpy"])
    extra = ["--device", "cpu"] if backend == "torch" else []
    got, records, _ = train_and_load(tmp_path, 1, [*args, "--backend", backend, *extra])
    assert records[-1]["backend"] == backend
    assert list(got) == list(want)
    for name, value in want.items():
        if value.dtype.kind in "iufc":
            scale = max(float(np.abs(value).max()), 1e-300)
            close = {"rtol": 1e-9, "atol": 1e-9 * scale, "err_msg": f"{model} {name}"}
            np.testing.assert_allclose(got[name], value, **close)
