"""``python -m bench step_phases`` times the phases of real training steps, on 1 rank and under
``mpiexec -n 2`` with shared memory. The figures are not checked, only that they add up."""

from __future__ import annotations

import gc
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import run_bench

from bench.benchmarks import step_phases
from bench.core import read_records
from xpnn.train import Callback

ARGS = [
    "--dataset", "synthetic", "--synthetic-size", "256", "--hidden", "96,700",
    "--epochs", "2", "--batch-size", "64", "--threads", "1", "--no-progress",
]  # fmt: skip
PHASES = ("step", "compute", "forward", "wgrad", "update", "fences")


def bench(*args: str) -> subprocess.CompletedProcess:
    return run_bench("step_phases", *args, timeout=180)


def _phases(ranks: int, extra: tuple[str, ...] = ()) -> list[dict]:
    """The records of one run, one per rank (``extra``: more xpnn arguments); each holds the
    last epoch's 4 steps."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "p.jsonl"
        proc = bench("--ranks", str(ranks), *ARGS, *extra, "--out", str(out))
        assert proc.returncode == 0, proc.stderr
        rs = read_records(out, "step_phases")
    assert "last epoch's 4 steps" in proc.stdout
    for r in rs:
        assert set(r["config"]) == {"rank", "ranks", "command"} and r["repeats"] == 4
        assert set(r["metrics"]) == {f"{p}_ms" for p in PHASES}
        samples = {p: r["metrics"][f"{p}_ms"]["samples"] for p in PHASES}
        for step, compute, update, fences in zip(
            samples["step"], samples["compute"], samples["update"], samples["fences"], strict=True
        ):  # every step's parts are that step's
            assert compute + update + fences == pytest.approx(step, rel=1e-9)
    return rs


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_step_phases_add_up_on_every_rank(ranks):
    rs = _phases(ranks)
    assert [r["config"]["rank"] for r in rs] == list(range(ranks))
    for r in rs:
        m = {p: r["metrics"][f"{p}_ms"]["median"] for p in PHASES}
        assert r["config"]["ranks"] == ranks and r["info"]["mean_ms"] > 0
        assert m["update"] > 0 and m["compute"] > 0  # the timers saw the optimizer and the rest
        assert 0 < m["forward"] < m["compute"] and 0 < m["wgrad"] < m["compute"]
        assert m["compute"] + m["update"] + m["fences"] <= m["step"] * 1.5 + 0.01  # medians
        assert (m["fences"] > 0) == (ranks > 1)  # one process has no fences


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--ranks", "0"], "bench: --ranks: must be >= 1, got 0"),
        (["--epochs", "x"], "bench: --epochs: not an integer: 'x'"),  # xpnn's flags, by xpnn
    ],
)
def test_a_bad_flag_is_one_line_before_training(args, line):
    proc = bench(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == line + "\n"


def test_help_is_the_suites_not_xpnns():
    """Every flag it does not know goes to xpnn, but ``--help`` is its own."""
    proc = bench("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m bench step_phases") and "--ranks" in proc.stdout


class _GcWatch(Callback):
    """Notes, at every step, whether automatic garbage collection is on."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_step_begin(self, trainer, step) -> None:  # noqa: ANN001
        self.seen.append(gc.isenabled())


def test_the_timed_steps_run_without_automatic_garbage_collection():
    """A full collection made due by Numba's compilation landed in the measured epoch (not of
    plain runs): collection is off while it trains, then on again."""
    watch = _GcWatch()
    timer = step_phases.time_phases(ARGS, callbacks=[watch])
    assert timer is not None and len(timer.steps) == 8
    assert len(watch.seen) == 8 and not any(watch.seen)
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

    from xpnn.record import phases
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

    from xpnn.backends import get_backend
    from xpnn.nn import Context, Dense, Flatten, Sequential
    from xpnn.nn.conv import Conv2D
    from xpnn.record import phases

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
