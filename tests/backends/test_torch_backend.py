"""PyTorch tensors as a backend: every layer's backward against finite differences on torch,
and torch == numpy in float64 for every layer, loss, optimizer and the presets. CPU tensors
(the CPU build of PyTorch is what CI installs)."""

import numpy as np
import pytest
import torch
from conftest import cnn_preset_step, run_xpnn
from test_backends import _assert_same, _run
from test_composite import CASES as COMPOSITE_CASES
from test_conv import LAYERS, _layer_run

from xpnn.backends import availability, get_backend
from xpnn.backends.kernels import Kernels
from xpnn.backends.torch_backend import TorchKernels, resolve_device, visible_devices
from xpnn.errors import UserError
from xpnn.nn import Context, Dense, Flatten, ReLU, Sequential, Sigmoid, Tanh, mlp
from xpnn.nn.conv import Conv2D
from xpnn.nn.dropout import Dropout
from xpnn.nn.pool import MaxPool2D
from xpnn.testing import check_layer, numeric_grad

RTOL = 1e-10

# every layer xpnn ships, built small: (factory, input shape of one sample)
EVERY_LAYER = [
    *[(lambda act=act: Dense(5, act), (7,)) for act in ("identity", "relu", "sigmoid", "tanh")],
    (ReLU, (6,)),
    (Sigmoid, (6,)),
    (Tanh, (6,)),
    (Flatten, (2, 3, 2)),
    (lambda: Conv2D(3, 3), (2, 5, 6)),
    (lambda: Conv2D(2, (3, 2), stride=2, padding=1), (2, 7, 6)),
    (lambda: Conv2D(3, 2, padding=1, activation="relu"), (2, 4, 3)),
    (lambda: Conv2D(3, 2, stride=2, activation="sigmoid"), (2, 5, 5)),
    (lambda: Conv2D(3, 2, activation="tanh"), (2, 4, 5)),
    (lambda: MaxPool2D(2), (2, 5, 7)),
    (lambda: MaxPool2D(3, stride=2), (2, 7, 6)),
    (lambda: Dropout(0.4), (3, 4, 5)),
]


@pytest.fixture
def torch64():
    return get_backend("torch", "float64", device="cpu")


@pytest.mark.parametrize("make, in_shape", EVERY_LAYER)
def test_every_layer_on_torch_matches_finite_differences(make, in_shape):
    check_layer(make(), in_shape, batch=2, backend="torch")


@pytest.mark.parametrize("loss", ["softmax_cross_entropy", "sigmoid_binary_cross_entropy"])
def test_losses_on_torch_match_finite_differences(torch64, loss):
    fn = getattr(torch64.kernels, loss)
    rng = np.random.default_rng(0)
    logits = torch64.asarray(rng.standard_normal((5, 4)) * 3)
    labels = torch64.asarray(np.array([0, 3, 1, 1, 2]), dtype=torch.int64)
    _, grad = fn(logits, labels, 0.5)
    numeric = numeric_grad(lambda: 0.5 * float(fn(logits, labels, 1.0)[0]), logits.numpy())
    np.testing.assert_allclose(grad.numpy(), numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("make, in_shape", EVERY_LAYER + LAYERS)
def test_every_layer_on_torch_equals_numpy_float64(torch64, make, in_shape):
    ref = _layer_run(get_backend("numpy", "float64"), make, in_shape)
    got = _layer_run(torch64, make, in_shape)
    for key in ref:
        np.testing.assert_allclose(got[key], ref[key], rtol=RTOL, atol=1e-13, err_msg=key)


@pytest.mark.parametrize("act", ["relu", "sigmoid", "tanh"])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adamw"])
def test_mlp_training_on_torch_equals_numpy_float64(torch64, act, optimizer):
    ref = _run(get_backend("numpy", "float64"), act, optimizer)
    _assert_same(ref, _run(torch64, act, optimizer))


def test_sigmoid_bce_on_torch_equals_numpy(torch64):
    ref = _run(get_backend("numpy", "float64"), loss="sigmoid_bce")
    _assert_same(ref, _run(torch64, loss="sigmoid_bce"))


def test_cnn_preset_on_torch_equals_numpy_float64(torch64):
    _, logits_ref, loss_ref, grads_ref = cnn_preset_step(get_backend("numpy", "float64"))
    model, logits, loss, grads = cnn_preset_step(torch64)
    assert model.size == 690590
    np.testing.assert_allclose(logits, logits_ref, rtol=RTOL, atol=1e-13)
    np.testing.assert_allclose(loss, loss_ref, rtol=RTOL)
    np.testing.assert_allclose(grads, grads_ref, rtol=RTOL, atol=1e-13)


@pytest.mark.parametrize("p, seed, step", [(0.5, 7, 3), (0.3, 2**40 + 5, 2**33), (0.9, 0, 0)])
def test_dropout_masks_are_bit_identical_to_the_uint32_hash(p, seed, step):
    """PyTorch hashes in int64 masked to 32 bits: the same bits as uint32 arithmetic."""
    ids = np.array([5, 900, 17, 2**35 + 3])
    want = Kernels(np).dropout_mask((4, 3, 5), p, seed, step, ids, np.float64)
    got = TorchKernels(get_backend("torch").xp).dropout_mask(
        (4, 3, 5), p, seed, step, torch.as_tensor(ids), torch.float64
    )
    np.testing.assert_array_equal(got.numpy(), want)


def test_tensors_need_no_autograd():
    """xpnn runs its own backward passes: nothing asks PyTorch to record a graph."""
    backend = get_backend("torch", "float32", device="cpu")
    model = mlp((8,)).build((4,), backend, 0)
    x = backend.asarray(np.ones((3, 4)))
    y = backend.asarray(np.array([0, 1, 2]), dtype=torch.int64)
    model.loss_and_grads(x, y, Context(train=True), 1 / 3)
    for t in (model.params, model.grads, model.forward(x, Context())):
        assert isinstance(t, torch.Tensor) and not t.requires_grad and t.grad_fn is None
    assert model.params.dtype == torch.float32 and model.params.device.type == "cpu"


def test_same_seed_same_initial_parameters_as_numpy():
    a = mlp((8,)).build((4,), get_backend("numpy", "float64"), 3).params
    b = mlp((8,)).build((4,), get_backend("torch", "float64"), 3).params
    np.testing.assert_array_equal(b.numpy(), a)


def test_host_arrays_are_shared_not_copied_on_the_cpu(torch64):
    host = np.arange(6.0)
    assert np.shares_memory(torch64.to_host(torch64.asarray(host)), host)


@pytest.mark.parametrize("name", [None, "auto", "cpu"])
def test_the_cpu_is_what_auto_finds_without_an_accelerator(name, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    assert resolve_device(torch, name) == torch.device("cpu")


@pytest.mark.parametrize(
    "name, message",
    [
        ("gpu", "`device` 'gpu': not a PyTorch device"),
        ("cuda:7", "this PyTorch build sees no cuda device"),
        ("mps", "this PyTorch build sees no mps device"),
    ],
)
def test_a_device_torch_cannot_use_is_a_user_error(name, message, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(UserError, match=message):
        resolve_device(torch, name)


def test_an_accelerator_without_an_index_is_the_ranks_own(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device(torch, "cuda", local_rank=3) == torch.device("cuda", 1)
    assert resolve_device(torch, "auto", local_rank=2) == torch.device("cuda", 0)
    with pytest.raises(UserError, match="only 2 cuda device"):
        resolve_device(torch, "cuda:2")


def test_device_is_refused_by_the_other_backends():
    with pytest.raises(UserError, match="`device` cpu: only for `backend` torch"):
        get_backend("numpy", device="cpu")


def test_info_lists_torch_and_the_devices_it_sees():
    assert availability()["torch"] is None
    assert visible_devices()[0] == "cpu"
    proc = run_xpnn(["info"])
    assert proc.returncode == 0, proc.stderr
    assert "  torch  available" in proc.stdout
    assert f"torch {torch.__version__} devices: cpu" in proc.stdout


def test_float64_on_apple_gpus_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    with pytest.raises(UserError, match="`dtype` float64: Apple's MPS devices have no float64"):
        get_backend("torch", "float64", device="mps")


@pytest.mark.parametrize("act", ["identity", "relu", "sigmoid", "tanh"])
def test_the_in_place_overrides_give_the_generic_results(act):
    xp = get_backend("torch").xp
    fast, generic = TorchKernels(xp), Kernels(xp)
    rng = np.random.default_rng(1)
    a, b = (
        torch.as_tensor(rng.standard_normal((6, 5))),
        torch.as_tensor(rng.standard_normal((5, 4))),
    )
    a[0, 0] = float("nan")  # a diverged run stays visible
    out = torch.empty(6, 4, dtype=torch.float64)
    assert fast.matmul_into(a, b, out) is out
    want = generic.matmul_into(a, b, torch.empty(6, 4, dtype=torch.float64))
    torch.testing.assert_close(out, want, equal_nan=True, rtol=0, atol=0)
    bias = torch.as_tensor(rng.standard_normal(4))
    torch.testing.assert_close(
        fast.bias_act(out.clone(), bias, act), generic.bias_act(out, bias, act), equal_nan=True
    )


@pytest.mark.parametrize("accelerator", [None, "cuda", "mps"])
def test_auto_takes_torch_where_pytorch_sees_an_accelerator(accelerator, monkeypatch):
    """Without CuPy, an AMD (ROCm: cuda), Apple (mps) or Intel GPU is PyTorch's to drive."""
    import xpnn.backends
    from xpnn.backends import auto_without_cupy

    monkeypatch.setattr(xpnn.backends, "accelerator_possible", lambda: True)  # its device files
    monkeypatch.setattr(torch.cuda, "is_available", lambda: accelerator == "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: accelerator == "mps")
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    assert auto_without_cupy() == ("numba" if accelerator is None else "torch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adamw"])
def test_the_optimizer_overrides_give_the_generic_bits(dtype, optimizer):
    """Subnormal, NaN and infinite state included, over three steps; AdamW's ``decay``."""
    xp = get_backend("torch").xp
    rng = np.random.default_rng(2)
    bufs = [torch.as_tensor(rng.standard_normal(1001) * 0.01, dtype=dtype) for _ in range(4)]
    bufs[3] = bufs[3].abs()
    bufs[2][:3] = torch.tensor([torch.finfo(dtype).smallest_normal / 4, float("nan"), -np.inf])
    copies = [b.clone() for b in bufs]
    for step in (1, 2, 3):
        for k, (p, g, m, v) in ((TorchKernels(xp), bufs), (Kernels(xp), copies)):
            if optimizer == "sgd":
                k.sgd_update(p, g, 0.1)
            elif optimizer == "momentum":
                k.momentum_update(p, g, m, 0.1, 0.9)
            else:
                decay = 0.97 if optimizer == "adamw" else 1.0
                k.adam_update(p, g, m, v, 1e-3, 0.9, 0.999, 1e-8, step, decay)
    for got, want in zip(bufs, copies, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("case", sorted(COMPOSITE_CASES))
def test_every_sequence_layer_on_torch_equals_numpy_float64(torch64, case):
    """The composite and sequence layers (LayerNorm, GELU, Residual, Embedding, attention,
    a transformer block) compute NumPy's forward, gradients and input gradient on torch."""
    make, in_shape, x = COMPOSITE_CASES[case]
    x_host = x()
    results = []
    for backend in (get_backend("numpy", "float64"), torch64):
        model = Sequential(make()).build(in_shape, backend, 0)
        xb = backend.asarray(x_host)
        y = model.forward(xb, Context(train=True))
        dy = backend.asarray(np.random.default_rng(5).standard_normal(tuple(y.shape)))
        dx = model.backward(dy, need_dx=x_host.dtype.kind == "f")
        results.append(
            (
                backend.to_host(y).copy(),
                backend.to_host(model.grads).copy(),
                None if dx is None else backend.to_host(dx).copy(),
            )
        )
    for ref, got in zip(*results, strict=True):
        if ref is not None:
            np.testing.assert_allclose(got, ref, rtol=RTOL, atol=1e-12)
