"""bench/step_phases.py times the phases of real training steps, on 1 rank and under
``mpiexec -n 2`` with shared memory. The figures are not checked, only that they add up."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, mpiexec_path

pytestmark = pytest.mark.mpi

ARGS = [
    "--dataset", "synthetic", "--synthetic-size", "256", "--hidden", "96,700",
    "--epochs", "2", "--batch-size", "64", "--threads", "1", "--no-progress",
]  # fmt: skip


def _phases(ranks: int, extra: tuple[str, ...] = ()) -> list[list[float]]:
    """The script's table, one row of numbers per rank (``extra``: more xpnn arguments)."""
    script = str(ROOT / "bench" / "step_phases.py")
    cmd = [sys.executable, script, *ARGS, *extra]
    if ranks > 1:
        cmd = [mpiexec_path(), "-n", str(ranks), *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("step phases"))
    assert "last epoch's 4 steps" in lines[head]
    table = [line.split() for line in lines[head + 1 :] if line.strip()]
    assert table[0] == ["rank", "mean", "step", "compute", "forward", "wgrad", "update", "fences"]
    return [[float(x) for x in row] for row in table[2:]]  # skip the header rule


@pytest.mark.parametrize("ranks", [1, 2])
def test_step_phases_add_up_on_every_rank(ranks):
    rows = _phases(ranks)
    assert [int(row[0]) for row in rows] == list(range(ranks))
    for _, mean, step, compute, forward, wgrad, update, fences in rows:
        assert mean > 0
        assert update > 0 and compute > 0  # the timers saw the optimizer and the rest
        assert 0 < forward < compute and 0 < wgrad < compute  # parts of compute
        assert compute + update + fences <= step * 1.5 + 0.01  # medians, so not exactly equal
        assert (fences > 0) == (ranks > 1)  # one process has no fences


def test_the_timed_steps_run_without_automatic_garbage_collection(monkeypatch):
    """A full collection made due by Numba's compilation landed in the measured epoch of this
    script (not of plain runs): the script keeps collection off while it trains, then on."""
    import gc

    from xpnn import train

    seen = []
    step = train.Trainer.step

    def watched(self, *args):
        seen.append(gc.isenabled())
        return step(self, *args)

    monkeypatch.setattr(train.Trainer, "step", watched)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import step_phases

    assert step_phases.main(ARGS) == 0
    assert len(seen) == 8 and not any(seen)
    assert gc.isenabled()


class _FakeDevice:
    """Work 'launched' by a call finishes only when the host synchronizes, as on a GPU."""

    def __init__(self) -> None:
        self.pending = 0.0
        self.syncs = 0

    def launch(self, seconds: float) -> None:
        self.pending += seconds

    def synchronize(self) -> None:
        import time

        self.syncs += 1
        time.sleep(self.pending)
        self.pending = 0.0


def _timed_step(is_gpu: bool, device: _FakeDevice) -> dict[str, float]:
    """One step with an update phase that launches 50 ms of device work, as PhaseTimer sees it
    on a backend that is (or is not) a GPU."""
    from types import SimpleNamespace

    from xpnn import phases
    from xpnn.train import PhaseTimer

    trainer = SimpleNamespace(
        backend=SimpleNamespace(is_gpu=is_gpu, synchronize=device.synchronize)
    )
    timer = PhaseTimer()
    timer.on_train_begin(trainer)
    try:
        timer.on_step_begin(trainer, 0)
        with phases.UPDATE:
            device.launch(0.05)
        timer.on_step_end(trainer, 0)
    finally:
        timer.on_train_end(trainer, {"event": "done"})
    (step,) = timer.steps
    return step


def test_on_a_device_each_phase_waits_for_its_work():
    """A timer that only read the clock would see the launch of asynchronous work, not the
    work: with the device's synchronize (a GPU backend), the phase holds its work."""
    device = _FakeDevice()
    for is_gpu, least, most in ((False, 0.0, 0.01), (True, 0.05, 1.0)):
        step = _timed_step(is_gpu, device)
        assert least <= step["update"] <= most
        assert step["update"] <= step["step"]
        device.synchronize()  # what the unsynchronized timer left behind
    assert device.syncs == 4 + 1 + 1  # around the phase and the step, and the two cleanups


def test_only_a_gpu_backend_makes_the_timers_synchronize():
    from xpnn.backends import get_backend

    for name in ("numpy", "numba"):
        assert not get_backend(name).is_gpu  # so PhaseTimer never synchronizes them
    device = _FakeDevice()
    _timed_step(False, device)
    assert device.syncs == 0
    _timed_step(True, device)
    assert device.syncs == 4


def test_a_conv_layers_forward_and_input_gradient_products_are_not_wgrad():
    """``wgrad`` is the weight gradients' products alone: not the convolutions' forward
    products (already in ``forward``) nor their input-gradient products."""
    import numpy as np

    from xpnn import phases
    from xpnn.backends import get_backend
    from xpnn.nn import Context, Dense, Flatten, Sequential
    from xpnn.nn.conv import Conv2D

    backend = get_backend("numpy", "float64")
    model = Sequential([Conv2D(2, 3), Conv2D(2, 3), Flatten(), Dense(3)])
    model.build((1, 8, 8), backend, 0)
    x = np.random.default_rng(0).random((2, 1, 8, 8))
    entered: list[str] = []
    phases.listen(lambda name, entering: entered.append(name) if entering else None)
    try:
        model.loss_and_grads(x, np.array([0, 2]), Context(train=True), scale=0.5)
    finally:
        phases.listen(None)
    # the weight gradients of the two convolutions and the Dense layer; one forward pass
    assert entered.count("wgrad") == 3
    assert entered.count("forward") == 1
