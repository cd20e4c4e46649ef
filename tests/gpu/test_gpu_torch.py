"""The torch backend on a CUDA (or ROCm) device: torch == numpy in float64 for the MLP and the
CNN preset, and 2 ranks equal 1 under mpiexec through MPI (staged, or CUDA-aware).

Skipped, with the reason, where PyTorch sees no CUDA device (as in CI, whose PyTorch is the
CPU build). A torch trace there holds device spans from PyTorch's CUDA events and the
staging copies.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import TINY_FLOAT64_RUN, cnn_preset_step, run_xpnn, train_and_load

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip(f"PyTorch {torch.__version__} sees no CUDA device", allow_module_level=True)

from test_backends import _assert_same, _run  # noqa: E402

from xpnn.backends import get_backend  # noqa: E402
from xpnn.record import phases  # noqa: E402


def test_mlp_training_on_cuda_tensors_equals_numpy():
    cuda = get_backend("torch", "float64", device="cuda")
    assert cuda.is_gpu and cuda.torch_device.type == "cuda"
    _assert_same(_run(get_backend("numpy", "float64")), _run(cuda), rtol=1e-9)


def test_cnn_preset_on_cuda_tensors_equals_numpy():
    _, logits_ref, loss_ref, grads_ref = cnn_preset_step(get_backend("numpy", "float64"))
    _, logits, loss, grads = cnn_preset_step(get_backend("torch", "float64", device="cuda"))
    np.testing.assert_allclose(logits, logits_ref, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-9)
    np.testing.assert_allclose(grads, grads_ref, rtol=1e-9, atol=1e-12)


@pytest.mark.mpi
@pytest.mark.parametrize("comm", ["auto", "mpi-host"])
def test_two_ranks_on_cuda_tensors_equal_one_numpy_rank(tmp_path, comm):
    args = [*TINY_FLOAT64_RUN, "--hidden", "96,64"]
    want, _, _ = train_and_load(tmp_path, 1, args)
    torch_args = [*args, "--backend", "torch", "--device", "cuda", "--comm", comm]
    got, records, _ = train_and_load(tmp_path, 2, torch_args)
    assert records[-1]["backend"] == "torch"
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-12, err_msg=name)


def test_a_torch_cuda_trace_has_device_spans(tmp_path):
    """Device spans from PyTorch's CUDA events (the trace imports no CuPy for torch)."""
    args = [*TINY_FLOAT64_RUN, "--backend", "torch", "--device", "cuda", "--trace", str(tmp_path)]
    proc = run_xpnn(args)
    assert proc.returncode == 0, proc.stderr
    events = json.loads((tmp_path / "trace-rank0.json").read_text())["traceEvents"]
    device = [e for e in events if e.get("ph") == "X" and e["tid"] == phases.DEVICE]
    assert any(e["name"].startswith("forward ") for e in device)


@pytest.mark.mpi
def test_staged_torch_allreduces_show_their_copies(tmp_path):
    args = [*TINY_FLOAT64_RUN, "--backend", "torch", "--device", "cuda", "--comm", "mpi-host"]
    proc = run_xpnn([*args, "--trace", str(tmp_path)], ranks=2)
    assert proc.returncode == 0, proc.stderr
    events = json.loads((tmp_path / "trace-rank0.json").read_text())["traceEvents"]
    copies = {e["name"] for e in events if e.get("ph") == "X" and e["tid"] == phases.COPIES}
    assert {"device to host", "host to device (queued)"} <= copies
