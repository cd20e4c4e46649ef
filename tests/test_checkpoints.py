"""Checkpoints hold the whole network, whatever parallelism wrote them (real mpiexec runs).

Each case writes a checkpoint after epoch 1 with one parallelism and resumes epoch 2 with
another (or the same); both must match one uninterrupted process: the checkpoint file to the
1-rank one, array by array (parameters and Adam's moments), and the resumed run's parameters
to the 1-rank run's.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY_FLOAT64_RUN, assert_one_line_user_error, run_xpnn

ARGS = [*TINY_FLOAT64_RUN, "--hidden", "96,64"]  # three Dense layers: a split pair + one more
MADE_5 = "written by a run that made 5 steps in 1 epoch(s)"  # 300 samples, batches of 70


def _load(path):
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


def _assert_same(got, want, what):
    assert list(got) == list(want), what  # the same names, in the same order
    for name, value in want.items():
        if value.dtype.kind == "U":  # meta.dataset
            assert got[name] == value, name
            continue
        scale = max(np.abs(value).max(), 1e-300)
        np.testing.assert_allclose(got[name], value, rtol=0, atol=1e-10 * scale, err_msg=name)


def _parallel(side):
    """``(kind, ranks)`` or ``(kind, ranks, model ranks)``: the flags of that layout."""
    flags = [] if side[0] == "data" else ["--parallel", side[0]]
    return flags + (["--model-ranks", str(side[2])] if len(side) > 2 else [])


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The uninterrupted 1-rank run: its epoch-1 checkpoint and its final parameters."""
    tmp = tmp_path_factory.mktemp("one")
    saved = tmp / "final.npz"
    proc = run_xpnn([*ARGS, "--checkpoint-dir", str(tmp / "ck"), "--save", str(saved)])
    assert proc.returncode == 0, proc.stderr
    return _load(tmp / "ck" / "checkpoint-epoch0001.npz"), _load(saved)


@pytest.fixture(scope="module")
def epoch1_dir(tmp_path_factory):
    """The checkpoint directory of a 1-epoch run of ARGS, which many tests damage or resume: the
    run is trained once, and each test gets its own copy (``epoch1_copy``)."""
    ck = tmp_path_factory.mktemp("epoch1") / "ck"
    proc = run_xpnn([*ARGS, "--epochs", "1", "--checkpoint-dir", str(ck)])
    assert proc.returncode == 0, proc.stderr
    return ck


@pytest.fixture
def epoch1_copy(tmp_path, epoch1_dir):
    """A copy of ``epoch1_dir`` at ``tmp_path / "ck"``, this test's own to change."""
    return Path(shutil.copytree(epoch1_dir, tmp_path / "ck"))


@pytest.mark.parametrize(
    "writer, reader",
    [
        (("pipeline", 2), ("pipeline", 2)),
        (("tensor", 2), ("tensor", 2)),
        (("tensor", 2), ("pipeline", 3)),
        (("pipeline", 2), ("data", 1)),
        (("tensor", 4, 2), ("pipeline", 4, 2)),  # 2 replicas x 2 ranks, written and read
        (("pipeline", 4, 2), ("data", 1)),
    ],
    ids=lambda side: f"{side[0]}{'x'.join(map(str, side[1:]))}",
)
def test_a_checkpoint_resumes_under_any_parallelism(tmp_path, one_rank, writer, reader):
    checkpoint, final = one_rank
    ck = tmp_path / "ck"
    first = run_xpnn(
        [*ARGS, *_parallel(writer), "--epochs", "1", "--checkpoint-dir", str(ck)],
        ranks=writer[1],
    )
    assert first.returncode == 0, first.stderr
    written = _load(ck / "checkpoint-epoch0001.npz")
    assert "optim.m.layer0.W" in written and written["optim.v.layer1.W"].shape == (96, 64)
    _assert_same(written, checkpoint, "the checkpoint")

    saved = tmp_path / "resumed.npz"
    args = [*ARGS, *_parallel(reader), "--checkpoint-dir", str(ck), "--resume"]
    second = run_xpnn([*args, "--save", str(saved)], ranks=reader[1])
    assert second.returncode == 0, second.stderr
    assert "resume:" in second.stdout and "(epoch 1, step 5)" in second.stdout
    _assert_same(_load(saved), final, "the resumed run")


def test_resuming_a_finished_run_trains_nothing_and_scores_it(tmp_path):
    import json

    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    first = run_xpnn([*ARGS, "--parallel", "pipeline", "--checkpoint-dir", str(ck)], ranks=2)
    assert first.returncode == 0, first.stderr
    done_then = first.stdout.splitlines()[-1]
    args = [*ARGS, "--checkpoint-dir", str(ck), "--resume", "--metrics", str(metrics)]
    again = run_xpnn(args)
    assert again.returncode == 0, again.stderr
    assert "(epoch 2, step 10); --epochs 2 reached, nothing to train" in again.stdout
    assert "epoch 1/" not in again.stdout and "epoch 2/" not in again.stdout
    (done,) = [json.loads(line, parse_constant=pytest.fail) for line in metrics.open()]
    assert f"test_acc {done['test_acc']:.4f}" in done_then  # the same network, scored again
    assert done["epochs"] == 2
    fewer = run_xpnn([*args, "--epochs", "1"])  # the checkpoint is further on than asked
    assert fewer.returncode == 0 and "done: 2 epochs" in fewer.stdout, fewer.stderr


@pytest.mark.parametrize(
    "other, message",
    [
        # stage 0 holds layer 0, which fits; it sees that the file is bigger than the network
        (["--hidden", "96,32"], "holds 82,218 parameters, the network has 78,794"),
        (["--optimizer", "momentum"], "optimizer state optim.velocity.layer0.W missing"),
    ],
)
def test_a_checkpoint_of_another_network_is_a_one_line_error(epoch1_copy, other, message):
    ck = epoch1_copy
    args = [*ARGS, *other, "--parallel", "pipeline", "--checkpoint-dir", str(ck), "--resume"]
    proc = run_xpnn(args, ranks=2, timeout=120)
    assert_one_line_user_error(proc, f"checkpoint-epoch0001.npz: {message}")
    assert "resume:" not in proc.stdout  # said only once every rank has accepted the file


def test_a_checkpoint_of_the_older_flat_layout_is_a_one_line_error(epoch1_copy):
    ck = epoch1_copy
    path = ck / "checkpoint-epoch0001.npz"
    named = _load(path)
    old = {k: v for k, v in named.items() if not k.startswith("optim.")}
    for state in ("m", "v"):  # the first layout: one flat buffer per state
        old[f"optim.{state}"] = np.concatenate(
            [v.ravel() for k, v in named.items() if k.startswith(f"optim.{state}.")]
        )
    np.savez(path, **old)
    proc = run_xpnn([*ARGS, "--checkpoint-dir", str(ck), "--resume"])
    assert_one_line_user_error(proc, "checkpoint-epoch0001.npz: written by an older xpnn")


def test_a_damaged_checkpoint_is_a_one_line_error(tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "checkpoint-epoch0003.npz").write_bytes(b"PK\x03\x04 not really a zip file")
    proc = run_xpnn([*ARGS, "--checkpoint-dir", str(ck), "--resume"])
    assert_one_line_user_error(proc, "checkpoint-epoch0003.npz: not a readable checkpoint")


def test_an_npz_that_is_no_checkpoint_is_a_one_line_error(tmp_path):
    """A --save file copied into the checkpoint directory: parameters, but no epoch or step."""
    ck = tmp_path / "ck"
    ck.mkdir()
    np.savez(ck / "checkpoint-epoch0002.npz", **{"layer0.W": np.zeros((2, 2))})
    proc = run_xpnn([*ARGS, "--checkpoint-dir", str(ck), "--resume"])
    assert_one_line_user_error(proc, "checkpoint-epoch0002.npz: not an xpnn checkpoint")


def test_saved_files_get_the_permissions_of_any_new_file(tmp_path):
    """The temporary file behind the atomic rename is created 0600; the result must not be."""
    from xpnn.train.checkpoint import atomic_savez

    atomic_savez(tmp_path / "saved.npz", {"a": np.zeros(3)})
    (tmp_path / "plain").write_bytes(b"")
    assert (tmp_path / "saved.npz").stat().st_mode == (tmp_path / "plain").stat().st_mode


@pytest.mark.parametrize(
    "written, resumed, message",
    [
        # every layer the network has is there, but the file has one more
        (["--hidden", "96,10"], ["--hidden", "96"], "holds 76,440 parameters, the network has"),
        # Adam's moments, resumed by SGD, which keeps none: they would be dropped silently
        ([], ["--optimizer", "sgd"], "optimizer state m, v, but this --optimizer keeps none"),
        ([], ["--seed", "7"], "written by a run with --seed 0, this one has --seed 7"),
        # other batches, and the schedule's steps moved (300 samples: 5 steps of 70, 4 of 80)
        ([], ["--batch-size", "80"], f"{MADE_5}, this one makes 4 an epoch (another "
         "global batch, --replicate or data set?)"),
        ([], ["--replicate", "2"], f"{MADE_5}, this one makes 9 an epoch"),
        ([], ["--synthetic-size", "400"], f"{MADE_5}, this one makes 6 an epoch"),
    ],
)  # fmt: skip
def test_a_checkpoint_with_more_than_the_network_or_another_seed_is_refused(
    request, tmp_path, written, resumed, message
):
    if written:
        ck = tmp_path / "ck"
        base = [*TINY_FLOAT64_RUN, "--epochs", "1", "--checkpoint-dir", str(ck)]
        assert run_xpnn([*base, *written]).returncode == 0
    else:  # written by ARGS (--hidden 96,64)
        ck = request.getfixturevalue("epoch1_copy")
        base = [*TINY_FLOAT64_RUN, "--epochs", "1", "--checkpoint-dir", str(ck)]
    proc = run_xpnn([*base, "--hidden", "96,64", *resumed, "--epochs", "2", "--resume"])
    assert_one_line_user_error(proc, f"checkpoint-epoch0001.npz: {message}")


def test_a_new_run_refuses_a_directory_of_another_runs_checkpoints(tmp_path):
    """Its checkpoints would mix with the other run's, and --resume would pick the other's."""
    ck = tmp_path / "ck"
    assert run_xpnn([*ARGS, "--epochs", "3", "--checkpoint-dir", str(ck)]).returncode == 0
    proc = run_xpnn([*ARGS, "--checkpoint-dir", str(ck), "--seed", "2"])
    assert_one_line_user_error(
        proc, f"--checkpoint-dir {ck}: holds another run's checkpoints (checkpoint-epoch0003.npz)"
    )
    assert sorted(p.name for p in ck.iterdir())[-1] == "checkpoint-epoch0003.npz"  # untouched


def test_the_latest_checkpoint_is_the_highest_epoch_by_number(tmp_path):
    from xpnn.train.checkpoint import latest_checkpoint

    for epoch in (9, 9999, 10000, 123):
        (tmp_path / f"checkpoint-epoch{epoch:04d}.npz").write_bytes(b"")
    (tmp_path / "checkpoint-epoch99999.npz.tmp").write_bytes(b"")  # a write cut short
    assert latest_checkpoint(tmp_path).name == "checkpoint-epoch10000.npz"


@pytest.mark.parametrize("value", [np.array([3, 4]), np.array("abc"), np.array(-5)])
def test_a_checkpoint_with_a_damaged_epoch_is_a_one_line_error(epoch1_copy, value):
    ck = epoch1_copy
    path = ck / "checkpoint-epoch0001.npz"
    np.savez(path, **{**_load(path), "meta.epoch": value})
    proc = run_xpnn([*ARGS, "--checkpoint-dir", str(ck), "--resume"])
    assert_one_line_user_error(proc, "checkpoint-epoch0001.npz: damaged checkpoint (meta.epoch")


def test_a_checkpoint_of_another_data_set_is_refused(tmp_path, epoch1_copy):
    """MNIST-shaped files of as many samples as the synthetic set make as many steps: only
    the data set's name in the checkpoint tells the runs apart."""
    from test_idx import small_arrays, write_mnist_dir

    ck = epoch1_copy
    written = _load(ck / "checkpoint-epoch0001.npz")
    assert str(written["meta.dataset"]) == "synthetic"
    files = write_mnist_dir(tmp_path / "d", small_arrays(n_train=300))
    other = ["--dataset", "mnist", "--data-dir", str(files)]
    proc = run_xpnn([*ARGS, *other, "--checkpoint-dir", str(ck), "--resume"])
    assert_one_line_user_error(
        proc, "checkpoint-epoch0001.npz: written by a run on synthetic, this one is on mnist"
    )


def test_a_checkpoint_with_a_damaged_data_set_name_is_a_one_line_error(epoch1_copy):
    ck = epoch1_copy
    path = ck / "checkpoint-epoch0001.npz"
    np.savez(path, **{**_load(path), "meta.dataset": np.array([1, 2])})
    proc = run_xpnn([*ARGS, "--checkpoint-dir", str(ck), "--resume"])
    assert_one_line_user_error(proc, "checkpoint-epoch0001.npz: damaged checkpoint (meta.dataset")


def test_a_checkpoint_that_names_no_data_set_still_resumes(epoch1_copy):
    """A checkpoint without meta.dataset or meta.settings (older files) still resumes."""
    ck = epoch1_copy
    path = ck / "checkpoint-epoch0001.npz"
    newer = ("meta.dataset", "meta.settings")
    np.savez(path, **{k: v for k, v in _load(path).items() if k not in newer})
    proc = run_xpnn([*ARGS, "--checkpoint-dir", str(ck), "--resume", "--lr", "0.002"])
    assert proc.returncode == 0 and "(epoch 1, step 5)" in proc.stdout, proc.stderr
    assert "changed since" not in proc.stdout  # nothing to compare with


def test_a_resume_that_changes_the_rates_to_come_says_so(tmp_path):
    """Not refused (a lower rate for the rest of a run is a choice), but never silent."""
    ck = tmp_path / "ck"
    base = [*ARGS, "--checkpoint-dir", str(ck), "--schedule", "step"]
    assert run_xpnn([*base, "--epochs", "1"]).returncode == 0
    settings = _load(ck / "checkpoint-epoch0001.npz")["meta.settings"]
    assert json.loads(str(settings)) == {
        "dtype": "float64", "lr": 0.01, "schedule": "step", "step_epochs": 1,
        "warmup_epochs": 0.0,
    }  # fmt: skip
    same = run_xpnn([*base, "--epochs", "2", "--step-epochs", "1", "--resume"])
    assert same.returncode == 0 and "changed since" not in same.stdout, same.stdout
    (ck / "checkpoint-epoch0002.npz").unlink()
    other = run_xpnn([*base, "--epochs", "2", "--resume", "--lr", "0.005", "--warmup-epochs", "1"])
    assert other.returncode == 0, other.stderr
    line = next(line for line in other.stdout.splitlines() if line.startswith("resume:"))
    assert line.endswith(
        "(epoch 1, step 5); changed since: --lr 0.01 -> 0.005, --warmup-epochs 0.0 -> 1.0"
    ), line


def test_a_checkpoint_with_damaged_settings_is_a_one_line_error(epoch1_copy):
    ck = epoch1_copy
    path = ck / "checkpoint-epoch0001.npz"
    np.savez(path, **{**_load(path), "meta.settings": np.array("[1, 2]")})
    proc = run_xpnn([*ARGS, "--checkpoint-dir", str(ck), "--resume"])
    assert_one_line_user_error(proc, "checkpoint-epoch0001.npz: damaged checkpoint (meta.settings")
