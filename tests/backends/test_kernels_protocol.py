"""Every backend's kernel class keeps the ``Kernels`` protocol: one class per backend, derived
from ``Kernels`` (Numba's from NumPy's) without mixins, overriding kernels with the protocol's
exact signatures and adding none of its own."""

import inspect

import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.backends.cupy_kernels import CupyKernels
from xpnn.backends.kernels import Kernels
from xpnn.backends.numba_kernels import NumbaKernels
from xpnn.backends.numpy_kernels import NumpyKernels
from xpnn.backends.torch_backend import TorchKernels

CLASSES = {"numpy": NumpyKernels, "numba": NumbaKernels, "cupy": CupyKernels}
CLASSES["torch"] = TorchKernels
BASES = {"numpy": Kernels, "numba": NumpyKernels, "cupy": Kernels, "torch": Kernels}


def _parameters(fn) -> list:
    """What a caller relies on: every parameter's name, kind and default, in order."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _kernels(cls) -> dict:
    """Public methods and attributes a class answers to, by name."""
    return {name: getattr(cls, name) for name in dir(cls) if not name.startswith("_")}


def test_the_protocol_lists_the_kernels_the_layers_and_optimizers_call():
    names = set(_kernels(Kernels))
    wanted = {"matmul_into", "bias_act", "bias_act_backward", "activation", "activation_grad"}
    wanted |= {"softmax_cross_entropy", "sigmoid_binary_cross_entropy", "count_correct"}
    wanted |= {"sum_rows", "sgd_update", "momentum_update", "adam_update", "flush_subnormal"}
    wanted |= {"sum_squares"}
    wanted |= {"im2col", "col2im", "conv_output", "conv_output_grad", "dropout_mask"}
    wanted |= {"maxpool2d_forward", "maxpool2d_backward"}
    assert wanted <= names


@pytest.mark.parametrize("backend", sorted(CLASSES))
def test_each_backend_class_is_flat(backend):
    """One class per backend on a single line of bases: no mixins, no chain of seven."""
    cls = CLASSES[backend]
    assert cls.__bases__ == (BASES[backend],)
    assert len(cls.__mro__) <= 4  # cls, NumPy's for Numba, Kernels, object


@pytest.mark.parametrize("backend", sorted(CLASSES))
def test_each_override_has_the_protocols_signature(backend):
    cls = CLASSES[backend]
    protocol = _kernels(Kernels)
    assert set(_kernels(cls)) == set(protocol), "a backend adds or lacks a kernel"
    for name, member in _kernels(cls).items():
        if not callable(member) or member is protocol[name]:
            continue
        assert _parameters(member) == _parameters(protocol[name]), name


@pytest.mark.parametrize("backend", ["numpy", "numba", "torch"])
def test_get_backend_hands_out_the_backends_class(backend):
    assert type(get_backend(backend, "float64").kernels) is CLASSES[backend]


@pytest.mark.parametrize("backend", ["reference", "numpy", "numba"])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_sum_rows_adds_the_rows_in_order(backend, rows):
    """The gradient of ranks that share memory: every backend adds the rows in row order, so
    their sums are bit-identical."""
    k = Kernels(np) if backend == "reference" else get_backend(backend, "float32").kernels
    rng = np.random.default_rng(rows)
    parts = tuple(rng.standard_normal(1001).astype(np.float32) for _ in range(rows))
    want = parts[0].copy()
    for part in parts[1:]:
        want += part
    out = np.full(1001, np.nan, np.float32)
    assert k.sum_rows(parts, out) is out
    np.testing.assert_array_equal(out, want)
