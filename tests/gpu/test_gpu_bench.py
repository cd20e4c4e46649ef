"""bench/step_phases.py on CuPy: its timers synchronize the device, and the phases add up.

Skipped, with the reason, where CuPy or a CUDA device is missing (as in CI).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

try:
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 1:
        pytest.skip("no CUDA device", allow_module_level=True)
except Exception as exc:  # ImportError, or CUDARuntimeError without a driver
    pytest.skip(f"no usable CuPy/CUDA device: {exc}", allow_module_level=True)

from test_bench_step_phases import _phases  # noqa: E402


def test_step_phases_on_cupy_add_up():
    (row,) = _phases(1, ("--backend", "cupy"))
    _, mean, step, compute, forward, wgrad, update, fences = row
    assert mean > 0 and update > 0 and fences == 0
    assert 0 < forward < compute and 0 < wgrad < compute
    assert compute + update <= step * 1.5 + 0.01
