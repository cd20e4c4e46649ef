"""The array-API subset the trainer and the layers use is the standard's: the trainer trains the
MLP and the GPT on ``array_api_strict`` (which refuses anything beyond the standard, such as
``take`` with 2-D indices) to NumPy's parameters in float64."""

import array_api_strict as xs
import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.backends.base import Backend
from xpnn.backends.kernels import Kernels
from xpnn.data import load_dataset
from xpnn.nn import build_model, gpt
from xpnn.parallel.comm import SelfCommunicator
from xpnn.run import RunSpec, train_config
from xpnn.train import Trainer


class StrictBackend(Backend):
    """The array API's strict namespace with the portable kernels: a test's backend only."""

    name = "strict"

    def __init__(self, dtype: str = "float64") -> None:
        super().__init__(xs, Kernels(xs), dtype)

    def to_host(self, a):
        return np.from_dlpack(a)


def _params_after(backend: Backend, model_name: str, tmp_path) -> np.ndarray:
    if model_name == "gpt":
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("to be or not to be, that is the question. " * 40)
        data = load_dataset("text", corpus, block=6)
        model = gpt(data.num_classes, layers=1, heads=2, embed=8, block=6)
    else:
        data = load_dataset("synthetic", synthetic_size=40)
        model = build_model("mlp", (12, 8), num_classes=data.num_classes)
    model.build(data.input_shape, backend, 0)
    spec = RunSpec(batch_size=8, steps=3, lr=0.01, optimizer="adamw", clip_norm=1.0)
    trainer = Trainer(model, data, backend, SelfCommunicator(), train_config(spec), log=print)
    trainer.run()
    return backend.to_host(model.params).copy()


@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_the_trainer_runs_on_the_strict_array_api(tmp_path, model_name):
    got = _params_after(StrictBackend(), model_name, tmp_path)
    want = _params_after(get_backend("numpy", "float64"), model_name, tmp_path)
    scale = np.abs(want).max()  # a value that nearly cancels is compared at the model's scale
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9 * scale)
