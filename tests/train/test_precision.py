"""Mixed precision (--precision bf16|fp16): fp32 runs are untouched, low-precision runs track
the fp32 run's loss, fp16's loss scaling skips an overflowing step and recovers, 2 ranks in bf16
compute the 1-rank run to bf16 round-off under real mpiexec, and bad flags are one line."""

import json
import math
import os
import signal

import numpy as np
import pytest
from conftest import assert_one_line_user_error, run_xpnn, train_and_load

from xpnn.run import RunSpec, build_run
from xpnn.runtime.world import init_world
from xpnn.train.callbacks import REQUEUE_EXIT, Callback, CheckpointOnSignal
from xpnn.train.precision import LossScale

RUN = [
    "--dataset", "synthetic", "--synthetic-size", "600", "--epochs", "2", "--batch-size", "60",
    "--hidden", "32,16", "--lr", "0.01", "--threads", "1", "--no-progress", "--backend", "numpy",
]  # fmt: skip
SMALL_CNN = [
    "--model", "cnn", "--dataset", "synthetic", "--synthetic-size", "96", "--batch-size", "32",
    "--epochs", "2", "--lr", "0.003", "--threads", "1", "--no-progress", "--backend", "numpy",
]  # fmt: skip
# How far apart two fp32 runs land that differ only in their seed, measured on RUN: the epoch-2
# train loss 1.12 (seed 2) to 1.33 (seed 0), 16 %. Low precision perturbs the steps by rounding
# (bf16 keeps 8 significant bits, fp16 11), not by a bias: its loss must stay within that spread.
# 10 % holds bf16 (6.7 % off, the worst seen) and fp16 (0.2 %), and fails a wrong step (a missing
# unscale is off by the loss scale, 2**15; a stale low-precision copy does not learn).
LOSS_RTOL, LOSS_ATOL = 0.10, 0.01


def _silent(line: str) -> None:
    pass


def test_the_loss_scale_halves_and_skips_on_overflow_and_doubles_after_good_steps():
    scale = LossScale(scale=8.0, growth_interval=3)
    assert scale.update(True) and scale.update(True)
    assert scale.scale == 8.0
    assert scale.update(True) and scale.scale == 16.0 and scale.good_steps == 0
    assert not scale.update(False)
    assert (scale.scale, scale.skipped, scale.good_steps) == (8.0, 1, 0)


@pytest.fixture(scope="module")
def fp32_run(tmp_path_factory):
    return train_and_load(tmp_path_factory.mktemp("fp32"), 1, RUN)


def test_fp32_is_the_run_without_the_flag(tmp_path, fp32_run):
    params, records, _ = fp32_run
    explicit, records32, _ = train_and_load(tmp_path, 1, [*RUN, "--precision", "fp32"])
    assert records32[-1]["params_sha256"] == records[-1]["params_sha256"]
    assert all("skipped_steps" not in r for r in records)  # the fp32 records as they were
    assert records[-1]["precision"] == "fp32"


def _assert_tracks(records, records32):
    for lp, full in zip(records[:-1], records32[:-1], strict=True):
        assert lp["train_loss"] == pytest.approx(full["train_loss"], rel=LOSS_RTOL, abs=LOSS_ATOL)
        assert lp["test_loss"] == pytest.approx(full["test_loss"], rel=LOSS_RTOL, abs=LOSS_ATOL)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_tracks_the_fp32_loss_on_the_mlp(tmp_path, fp32_run, precision):
    params32, records32, _ = fp32_run
    params, records, _ = train_and_load(tmp_path, 1, [*RUN, "--precision", precision])
    _assert_tracks(records, records32)
    assert records[-1]["precision"] == precision and records[-1]["skipped_steps"] == 0
    for name, value in params.items():  # the saved parameters are the fp32 master ones
        assert value.dtype == np.float32 and np.all(np.isfinite(value)), name
    assert records[0]["train_loss"] != records32[0]["train_loss"]  # it did run in low precision


def test_bf16_tracks_the_fp32_loss_on_a_small_cnn(tmp_path):
    _, records32, _ = train_and_load(tmp_path, 1, SMALL_CNN)
    _, records, _ = train_and_load(tmp_path, 1, [*SMALL_CNN, "--precision", "bf16"])
    _assert_tracks(records, records32)


def test_fp16_skips_the_overflowing_steps_and_recovers(tmp_path):
    spec = RunSpec(**{"dataset": "synthetic", "synthetic_size": 600, "hidden": (32, 16)})
    spec.epochs, spec.batch_size, spec.lr, spec.threads, spec.progress = 2, 60, 0.01, 1, False
    spec.precision, spec.metrics = "fp16", str(tmp_path / "m.jsonl")
    trainer = build_run(spec, init_world(), log=_silent)
    trainer.precision.loss_scale.scale = 2.0**24  # the first scaled gradients overflow 65504
    done = trainer.run()
    skipped = done["skipped_steps"]
    assert 1 <= skipped <= 12  # halved until the scaled gradients fit (2**24 -> about 2**15)
    assert trainer.optimizer.step_count + skipped == 20  # 2 epochs x 10 steps: none lost
    assert trainer.precision.loss_scale.scale == 2.0 ** (24 - skipped)
    assert np.all(np.isfinite(trainer.model.params))
    epochs = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert epochs[0]["skipped_steps"] == skipped  # all in the first epoch's first steps
    assert epochs[1]["train_loss"] < epochs[0]["train_loss"]  # it learns after them
    assert done["test_loss"] < 0.8 * math.log(10)  # well below the untrained loss, ln 10


SGD_STEPS = [  # 3 steps of plain SGD: round-off reaches the parameters as lr x gradient
    "--dataset", "synthetic", "--synthetic-size", "180", "--epochs", "1", "--batch-size", "60",
    "--hidden", "32,16", "--threads", "1", "--no-progress", "--backend", "numpy",
    "--optimizer", "sgd", "--lr", "0.1",
]  # fmt: skip


@pytest.fixture(scope="module")
def one_rank_bf16(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bf16")
    full, _, _ = train_and_load(tmp, 1, SGD_STEPS)
    one, _, _ = train_and_load(tmp, 1, [*SGD_STEPS, "--precision", "bf16"])
    return one, {name: np.abs(one[name] - full[name]).max() for name in one}


@pytest.mark.parametrize("comm", ["mpi-host", "mpi-shm"])
def test_two_ranks_in_bf16_compute_the_one_rank_run(tmp_path, one_rank_bf16, comm):
    """To round-off, not bit-for-bit: each rank rounds its half-batch gradient to bf16 before
    the fp32 sum, one rank rounds the whole batch's. So the yardstick is bf16's own rounding:
    2 ranks differ from 1 rank by at most twice what bf16 differs from fp32 on 1 rank."""
    one, bf16_vs_fp32 = one_rank_bf16
    two, records, _ = train_and_load(
        tmp_path, 2, [*SGD_STEPS, "--precision", "bf16", "--comm", comm]
    )
    assert records[-1]["ranks_agree"] and records[-1]["world_size"] == 2
    for name in one:
        assert 0 < bf16_vs_fp32[name] < 1e-2, name  # the yardstick: small, but not nothing
        assert np.abs(two[name] - one[name]).max() <= 2 * bf16_vs_fp32[name], name


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--precision", "fp8"], "--precision: invalid choice: 'fp8'"),
        (["--precision", "bf16", "--parallel", "tensor"], "--precision bf16: only with"),
        (["--precision", "fp16", "--node-share", "activations"], "not with --node-share"),
    ],
)
def test_bad_precision_flags_are_one_line(flags, message):
    assert_one_line_user_error(run_xpnn([*RUN, *flags]), message)


def test_numba_hands_low_precision_to_numpys_kernels_and_says_so(tmp_path):
    flags = [*RUN, "--backend", "numba", "--precision", "bf16"]
    _, records, proc = train_and_load(tmp_path, 1, flags)
    assert records[-1]["backend"] == "numpy"
    assert "note: --precision bf16: NumPy's kernels run it" in proc.stderr


def test_fp16_with_accumulation_and_clipping_on_two_ranks(tmp_path):
    flags = [*RUN, "--precision", "fp16", "--accumulate", "2", "--clip-norm", "0.5"]
    _, records, _ = train_and_load(tmp_path, 2, flags)
    assert records[-1]["ranks_agree"] and records[-1]["skipped_steps"] == 0
    assert records[-1]["update"] == "shared gradients"  # mpi-shm: gradients, not activations
    assert records[1]["train_loss"] < records[0]["train_loss"]


def test_a_resumed_bf16_run_is_the_uninterrupted_one(tmp_path):
    """Checkpoints hold the fp32 master parameters and state; the bf16 copy is cast from them."""
    flags = [*RUN, "--precision", "bf16", "--checkpoint-dir", str(tmp_path / "ck")]
    whole, _, _ = train_and_load(tmp_path, 1, [*RUN, "--precision", "bf16"])
    first = run_xpnn([*flags, "--epochs", "1"])
    assert first.returncode == 0, first.stderr
    resumed, records, _ = train_and_load(tmp_path, 1, [*flags, "--resume"])
    assert records[-1]["epochs"] == 2
    for name in whole:
        np.testing.assert_array_equal(resumed[name], whole[name], err_msg=name)


def _fp16_trainer(checkpoint_dir, epochs, resume=False, stop_signal=None, callbacks=()):
    """The fp16 MLP run; a new one starts at a loss scale that overflows (steps are skipped),
    and every one doubles its scale after 4 good steps, so the scale moves all the time."""
    spec = RunSpec(**{"dataset": "synthetic", "synthetic_size": 600, "hidden": (32, 16)})
    spec.epochs, spec.batch_size, spec.lr, spec.threads, spec.progress = epochs, 60, 0.01, 1, False
    spec.precision, spec.checkpoint_dir, spec.resume = "fp16", str(checkpoint_dir), resume
    if stop_signal:  # the command line's --checkpoint-signal: a callback
        callbacks = [CheckpointOnSignal(stop_signal, spec.checkpoint_dir), *callbacks]
    trainer = build_run(spec, init_world(), callbacks, log=_silent)
    if not resume:  # a resumed run's scale is the checkpoint's
        trainer.loss_scale.scale = 2.0**18
    trainer.loss_scale.growth_interval = 4
    return trainer


def test_a_resumed_fp16_run_is_the_uninterrupted_one_with_its_loss_scale(tmp_path):
    """The scale, its count of good steps and the skipped steps come back from the checkpoint:
    the resumed run scales, skips and rounds as the uninterrupted one, to the last bit."""
    whole = _fp16_trainer(tmp_path / "whole", 2)
    done = whole.run()
    first = _fp16_trainer(tmp_path / "ck", 1)
    first.run()
    assert first.loss_scale.skipped >= 1 and first.loss_scale.good_steps > 0  # both matter
    resumed = _fp16_trainer(tmp_path / "ck", 2, resume=True)
    assert resumed.loss_scale.state() == first.loss_scale.state()
    again = resumed.run()
    np.testing.assert_array_equal(resumed.model.params, whole.model.params)
    assert again["skipped_steps"] == done["skipped_steps"] > first.loss_scale.skipped
    assert resumed.loss_scale.state() == whole.loss_scale.state()


def test_only_a_loss_scaled_run_keeps_a_loss_scale_in_its_checkpoints(tmp_path):
    for precision in ("bf16", "fp16"):
        ck = tmp_path / precision
        flags = [*RUN, "--epochs", "1", "--precision", precision, "--checkpoint-dir", str(ck)]
        assert run_xpnn(flags).returncode == 0
        with np.load(ck / "checkpoint-epoch0001.npz") as data:
            stored = data["meta.loss_scale"] if "meta.loss_scale" in data.files else None
        if precision == "bf16":
            assert stored is None
        else:
            assert json.loads(str(stored)) == {"good_steps": 10, "scale": 2.0**15, "skipped": 0}


def _fp16_checkpoint(tmp_path, **meta):
    """An fp16 run's first checkpoint, its ``meta.loss_scale`` replaced (None: removed)."""
    ck = tmp_path / "ck"
    flags = [*RUN, "--precision", "fp16", "--checkpoint-dir", str(ck)]
    assert run_xpnn([*flags, "--epochs", "1"]).returncode == 0
    path = ck / "checkpoint-epoch0001.npz"
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files if k != "meta.loss_scale"}
    if meta["loss_scale"] is not None:
        arrays["meta.loss_scale"] = np.array(json.dumps(meta["loss_scale"]))
    np.savez(path, **arrays)
    return [*flags, "--resume"]


def test_a_checkpoint_without_a_loss_scale_resumes_from_the_first_scale_and_says_so(tmp_path):
    """A file written without loss scaling (another precision, or before checkpoints held
    the scale) still resumes; the scale starts as a new run's does, and the resume line says so."""
    proc = run_xpnn(_fp16_checkpoint(tmp_path, loss_scale=None))
    assert proc.returncode == 0, proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("resume:"))
    assert line.endswith(
        "(epoch 1, step 10); the loss scale starts at 32768 (the checkpoint has none)"
    )


@pytest.mark.parametrize(
    ("stored", "said"),
    [({"scale": -1.0, "good_steps": 0, "skipped": 0}, "scale is -1.0"),
     ({"scale": 8.0, "good_steps": 1.5, "skipped": 0}, "good_steps is 1.5"),
     ({"scale": 8.0, "good_steps": 0}, "skipped is None")],
)  # fmt: skip
def test_a_damaged_loss_scale_is_a_one_line_error(tmp_path, stored, said):
    proc = run_xpnn(_fp16_checkpoint(tmp_path, loss_scale=stored))
    assert_one_line_user_error(proc, f"damaged checkpoint (meta.loss_scale's {said})")


class _SignalAt(Callback):
    """Sends this process SIGUSR1 during step ``step`` (from 1)."""

    def __init__(self, step):
        self.step = step

    def on_step_begin(self, trainer, step):
        if step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)


def test_an_fp16_run_stopped_mid_epoch_resumes_past_its_skipped_steps(tmp_path):
    """A mid-epoch checkpoint of a run that skipped steps: the resume skips the batches behind
    the model (its optimizer's steps and the skipped ones, not the first alone), so it ends as
    the uninterrupted run, to the last bit."""
    whole = _fp16_trainer(tmp_path / "whole", 2)
    done = whole.run()
    first = _fp16_trainer(tmp_path / "ck", 2, stop_signal="USR1", callbacks=[_SignalAt(7)])
    with pytest.raises(SystemExit) as stop:
        first.run()
    assert stop.value.code == REQUEUE_EXIT
    assert first.loss_scale.skipped >= 1  # the resume must count them
    assert first.optimizer.step_count + first.loss_scale.skipped == 7  # mid-epoch (10 a epoch)
    resumed = _fp16_trainer(tmp_path / "ck", 2, resume=True)
    again = resumed.run()
    np.testing.assert_array_equal(resumed.model.params, whole.model.params)
    assert again["skipped_steps"] == done["skipped_steps"]
