"""A resume trusts nothing in a checkpoint it cannot check, and old checkpoints are pruned.

Each damaged file is refused in one line naming the file and the entry, exit 2: values that
are not finite, meta values out of bounds, files that are no ``.npz`` at all. Pruning keeps the
newest ``--keep-checkpoints`` and never removes one before its successor is complete.
"""

import pickle
import shutil

import numpy as np
import pytest
from conftest import TINY_FLOAT64_RUN, assert_one_line_user_error, run_xpnn

ARGS = [*TINY_FLOAT64_RUN, "--hidden", "16"]
FIRST = "checkpoint-epoch0001.npz"


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A checkpoint directory after 2 epochs (epochs 1 and 2 kept)."""
    ck = tmp_path_factory.mktemp("written") / "ck"
    proc = run_xpnn([*ARGS, "--checkpoint-dir", str(ck)])
    assert proc.returncode == 0, proc.stderr
    return ck


def _copy_first(written, tmp_path):
    """A directory holding only the epoch-1 checkpoint, and its arrays."""
    ck = tmp_path / "ck"
    ck.mkdir()
    shutil.copy(written / FIRST, ck / FIRST)
    with np.load(ck / FIRST) as data:
        return ck, {k: data[k] for k in data.files}


def _resume(ck, *extra):
    return run_xpnn([*ARGS, "--checkpoint-dir", str(ck), "--resume", *extra])


@pytest.mark.parametrize(
    "entry, value",
    [("layer0.W", np.nan), ("layer1.b", np.inf), ("optim.v.layer0.b", -np.inf)],
)
def test_values_that_are_not_finite_are_refused_naming_the_entry(written, tmp_path, entry, value):
    ck, arrays = _copy_first(written, tmp_path)
    arrays[entry] = np.full_like(arrays[entry], value)
    np.savez(ck / FIRST, **arrays)
    proc = _resume(ck)
    assert_one_line_user_error(proc, f"{FIRST}: damaged checkpoint ({entry} holds")
    assert "NaN or infinite" in proc.stderr and "diverged" not in proc.stderr


def test_negative_adam_second_moments_are_refused_as_damage(written, tmp_path):
    """A mean of squares is never negative: resumed, it would end as "training diverged"."""
    ck, arrays = _copy_first(written, tmp_path)
    arrays["optim.v.layer0.W"].flat[3] = -1e-3
    np.savez(ck / FIRST, **arrays)
    proc = _resume(ck)
    assert_one_line_user_error(
        proc, f"{FIRST}: damaged checkpoint (optim.v.layer0.W holds negative"
    )
    assert "diverged" not in proc.stderr


def test_fp16_with_an_overflowing_rate_says_one_line_without_numpys_warning():
    proc = run_xpnn([*ARGS, "--dtype", "float32", "--precision", "fp16", "--lr", "1e30"])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and "diverged" in lines[0], proc.stderr
    assert "RuntimeWarning" not in proc.stderr


def test_an_epoch_past_any_run_is_refused_even_with_a_matching_step(written, tmp_path):
    """A forged epoch of 10**12 with the step count that goes with it: no run can write it."""
    ck, arrays = _copy_first(written, tmp_path)
    arrays["meta.epoch"] = np.array(10**12)
    arrays["meta.step"] = np.array(5 * 10**12)
    np.savez(ck / FIRST, **arrays)
    proc = _resume(ck)
    assert_one_line_user_error(proc, f"{FIRST}: damaged checkpoint (meta.epoch is 1000000000000")


def test_fewer_steps_than_epochs_is_refused(written, tmp_path):
    ck, arrays = _copy_first(written, tmp_path)
    arrays["meta.step"] = np.array(0)
    np.savez(ck / FIRST, **arrays)
    assert_one_line_user_error(_resume(ck), f"{FIRST}: damaged checkpoint (meta.step 0")


@pytest.mark.parametrize(
    "content",
    [
        pickle.dumps({"layer0.W": [1.0, 2.0]}),  # a pickle named like a checkpoint
        b"\x93NUMPY",  # the start of a .npy file
        b"",  # a file left empty
    ],
    ids=["pickle", "npy", "empty"],
)
def test_a_file_that_is_no_npz_is_not_an_xpnn_checkpoint(tmp_path, content):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / FIRST).write_bytes(content)
    proc = _resume(ck)
    assert_one_line_user_error(proc, f"{FIRST}: not an xpnn checkpoint (not an .npz file)")
    assert "pickle" not in proc.stderr


def test_a_saved_npy_array_is_not_an_xpnn_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    with open(ck / FIRST, "wb") as fh:
        np.save(fh, np.zeros(3))
    assert_one_line_user_error(_resume(ck), f"{FIRST}: not an xpnn checkpoint")


def test_a_damaged_newest_checkpoint_names_the_one_before_it(written, tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(written, ck)
    (ck / "checkpoint-epoch0002.npz").write_bytes(b"cut short")
    proc = _resume(ck, "--epochs", "3")
    assert_one_line_user_error(proc, f"the one before it, {FIRST}, remains")


@pytest.mark.parametrize("keep, kept", [(None, [3, 4]), (1, [4]), (0, [1, 2, 3, 4])])
def test_keep_checkpoints_keeps_the_newest(tmp_path, keep, kept):
    ck = tmp_path / "ck"
    flags = [] if keep is None else ["--keep-checkpoints", str(keep)]
    proc = run_xpnn([*ARGS, "--epochs", "4", "--checkpoint-dir", str(ck), *flags])
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in ck.iterdir()) == [f"checkpoint-epoch{e:04d}.npz" for e in kept]


def test_a_failed_write_prunes_nothing_and_leaves_no_temporary_file(written, tmp_path):
    """The disk fills while epoch 3's checkpoint is written: one line naming the directory,
    exit 2, and epochs 1 and 2 still there to resume from."""
    ck = tmp_path / "ck"
    shutil.copytree(written, ck)
    proc = run_xpnn(
        [*ARGS, "--epochs", "3", "--checkpoint-dir", str(ck), "--resume"],
        env={"XPNN_SAVE_FAULT": "enospc"},
    )
    assert_one_line_user_error(proc, f"--checkpoint-dir {ck}: No space left on device")
    assert sorted(p.name for p in ck.iterdir()) == [FIRST, "checkpoint-epoch0002.npz"]


def test_keep_checkpoints_refuses_a_negative_count_and_notes_no_directory():
    proc = run_xpnn([*ARGS, "--keep-checkpoints", "-1"])
    assert_one_line_user_error(proc, "--keep-checkpoints: must be from 0 to")
    proc = run_xpnn([*ARGS, "--epochs", "1", "--keep-checkpoints", "3"])
    assert proc.returncode == 0, proc.stderr
    assert "--keep-checkpoints has no effect without --checkpoint-dir" in proc.stderr


def test_prune_removes_only_the_oldest(tmp_path):
    from xpnn.train.checkpoint import prune_checkpoints

    for epoch in (1, 2, 10, 9999, 10000):
        (tmp_path / f"checkpoint-epoch{epoch:04d}.npz").write_bytes(b"")
    (tmp_path / "other.npz").write_bytes(b"")
    removed = prune_checkpoints(tmp_path, 2)
    assert [p.name for p in removed] == [
        "checkpoint-epoch0001.npz",
        "checkpoint-epoch0002.npz",
        "checkpoint-epoch0010.npz",
    ]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["checkpoint-epoch10000.npz", "checkpoint-epoch9999.npz", "other.npz"]
