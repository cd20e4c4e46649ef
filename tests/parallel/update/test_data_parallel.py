"""Data parallelism under real ``mpiexec``: N ranks compute the 1-rank run; failures stop all."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import (
    ROOT,
    TINY_FLOAT64_RUN,
    assert_failing_rank_stops_the_job,
    assert_one_line_user_error,
    mpiexec_path,
    run_xpnn,
    train_and_load,
    xpnn_cmd,
)

from xpnn.backends import get_backend
from xpnn.nn import build_model
from xpnn.parallel.update.base import MIN_LAYER_BUCKET, bucket_bounds, layer_buckets

# Hidden 96,700: two Dense layers of >= MIN_LAYER_BUCKET values, so the layer-by-layer update
# runs in two buckets (test_base_model_is_updated_in_two_buckets).
HIDDEN = (96, 700)
BASE = [*TINY_FLOAT64_RUN, "--hidden", ",".join(map(str, HIDDEN))]


def _train(tmp_path, ranks, *extra, name="p", env=None):
    saved, metrics = tmp_path / f"{name}{ranks}.npz", tmp_path / f"{name}{ranks}.jsonl"
    base = BASE
    if "--per-rank-batch" in extra:  # the two batch flags together are refused
        i = BASE.index("--batch-size")
        base = BASE[:i] + BASE[i + 2 :]
    if ranks == 1 and env is None:  # the reference run, trained once per pytest run
        params, records, _ = train_and_load(tmp_path, 1, [*base, *extra])
        return params, records
    args = [*base, *extra, "--save", str(saved), "--metrics", str(metrics)]
    proc = run_xpnn(args, ranks=ranks, env=env)
    assert proc.returncode == 0, proc.stderr
    with np.load(saved) as data:
        params = {k: data[k] for k in data.files}
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return params, records


def _assert_close(a, b):
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-10, atol=1e-13, err_msg=name)


# (communicator flags, the update scheme they give); what auto picks depends on the batch
# (test_auto_shares_memory_on_one_node)
SCHEMES = [
    (["--comm", "mpi-shm", "--node-share", "activations"], "shared activations"),
    (["--comm", "mpi-shm", "--node-share", "gradients"], "shared gradients"),
    (["--comm", "mpi-host"], "allreduce"),
]


@pytest.mark.parametrize(("flags", "scheme"), SCHEMES)
def test_one_two_and_three_ranks_compute_the_same_run(tmp_path, flags, scheme):
    one, rec1 = _train(tmp_path, 1)
    two, rec2 = _train(tmp_path, 2, *flags)
    three, rec3 = _train(tmp_path, 3, *flags)
    _assert_close(one, two)
    _assert_close(one, three)
    assert rec1[-1]["update"] == "local"
    assert rec2[-1]["update"] == scheme and rec3[-1]["update"] == scheme
    assert rec2[-1]["world_size"] == 2 and rec2[-1]["comm"] == flags[1]
    assert rec3[-1]["ranks_agree"] and rec2[-1]["ranks_agree"]
    # Metrics are exact sums over ranks, not averages of padded shards.
    for r1, r3 in zip(rec1[:2], rec3[:2], strict=True):
        assert r1["train_loss"] == pytest.approx(r3["train_loss"], rel=1e-10)
        assert r1["test_acc"] == r3["test_acc"]
    # Training moved the parameters: equality is not the trivial kind.
    assert rec1[1]["train_loss"] < rec1[0]["train_loss"]


@pytest.mark.parametrize("hidden", ["8,96", "96,8", "8,8"])
@pytest.mark.parametrize("small", [False, True], ids=["batch70", "batch2"])
def test_layers_split_by_units_next_to_layers_split_by_samples(tmp_path, hidden, small):
    """Sharing activations, the ranks split a wide Dense by its units and a narrow one (8
    units, 10 outputs) by samples: with the wide layer above the narrow one, below it, and
    none, 3 ranks compute the 1-rank run; with a global batch of 2 too (a rank without
    samples in every step meets the others at every fence)."""
    extra = ["--hidden", hidden]
    if small:
        extra += ["--batch-size", "2", "--synthetic-size", "301", "--epochs", "1"]
    flags = ["--comm", "mpi-shm", "--node-share", "activations"]
    one, _ = _train(tmp_path, 1, *extra, name="mixed")
    three, rec3 = _train(tmp_path, 3, *extra, *flags, name="mixed")
    assert rec3[-1]["update"] == "shared activations"
    _assert_close(one, three)


def test_base_model_is_updated_in_two_buckets():
    model = build_model("mlp", HIDDEN).build((1, 28, 28), get_backend("numpy", "float64"), 0)
    assert len(layer_buckets(model.layer_offsets, model.size, MIN_LAYER_BUCKET)) == 2


@pytest.mark.parametrize(("flags", "scheme"), SCHEMES)
def test_ranks_left_without_samples_still_compute_the_one_rank_run(tmp_path, flags, scheme):
    """A global batch of 2 on 3 ranks (the last batch of 301 samples has 1): the ranks with
    no sample contribute zero gradients and zero loss, and the run is still the 1-rank one."""
    small = ["--batch-size", "2", "--synthetic-size", "301", "--epochs", "1"]
    one, rec1 = _train(tmp_path, 1, *small, name="b2")
    three, rec3 = _train(tmp_path, 3, *small, *flags, name="b2")
    assert rec3[-1]["update"] == scheme
    _assert_close(one, three)
    assert rec3[0]["train_loss"] == pytest.approx(rec1[0]["train_loss"], rel=1e-10)
    assert rec3[0]["train_acc"] == rec1[0]["train_acc"]


def test_bucket_size_does_not_change_the_result(tmp_path):
    # 10 kB buckets: ~120 over the 150k parameters, most cutting through a layer
    tiny, _ = _train(tmp_path, 2, "--comm", "mpi-host", "--bucket-mb", "0.01", name="tiny")
    one_bucket, _ = _train(tmp_path, 2, "--comm", "mpi-host", "--bucket-mb", "100", name="one")
    _assert_close(tiny, one_bucket)


def test_bucket_bounds_cover_the_buffer_from_the_end():
    assert bucket_bounds(10, 4) == [(6, 10), (2, 6), (0, 2)]
    assert bucket_bounds(10, 100) == [(0, 10)]
    assert bucket_bounds(3, 0) == [(2, 3), (1, 2), (0, 1)]


def test_all_ranks_hold_identical_parameters(tmp_path):
    # mpi-host: every rank holds its own copy (with mpi-shm the node has one copy to compare)
    _, records = _train(tmp_path, 3, "--dtype", "float32", "--comm", "mpi-host")
    assert records[-1]["ranks_agree"] is True
    assert len(records[-1]["params_sha256"]) == 64


@pytest.mark.parametrize("comm", ["mpi-shm", "mpi-host"])
def test_one_failing_rank_stops_the_job(comm):
    assert_failing_rank_stops_the_job([*BASE, "--epochs", "50", "--comm", comm])


@pytest.mark.parametrize(
    ("signum", "code", "said_word"),
    [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated (SIGTERM)")],
)
@pytest.mark.parametrize("ranks", [1, 2])
def test_ctrl_c_or_sigterm_stops_every_rank(tmp_path, ranks, signum, code, said_word):
    """SIGINT (Ctrl-C) or SIGTERM (Slurm's time limit, scancel), to the process or to mpiexec
    (which passes it on to the ranks), after the second epoch: each rank says so (no traceback,
    no KeyboardInterrupt) and exits 130 or 143, leaving no half-written checkpoint, never
    silently as ``mpiexec``'s BAD TERMINATION."""
    ckpt = tmp_path / "ck"
    cmd = xpnn_cmd([*BASE, "--epochs", "500", "--checkpoint-dir", str(ckpt)], ranks)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # A shell's background job inherits SIGINT ignored, and Python then never raises
        # KeyboardInterrupt: give the child the default disposition, as a terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        line = ""
        while not line.startswith("epoch 2/"):  # so epoch 1's checkpoint is written
            line = proc.stdout.readline()
            assert line, proc.stderr.read()  # it ended before its first epoch
        time.sleep(0.2)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    said = [line for line in err.splitlines() if line.endswith(f": {said_word}")]
    assert 1 <= len(said) <= ranks, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert list(ckpt.glob("checkpoint-epoch*.npz")) and not list(ckpt.glob("*.tmp"))


def test_user_error_on_every_rank_is_printed_once(tmp_path):
    proc = run_xpnn([*BASE, "--dataset", "mnist", "--data-dir", str(tmp_path)], ranks=2)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and str(tmp_path) in lines[0], proc.stderr


def test_per_rank_batch_with_linear_lr_scaling_trains(tmp_path):
    _, records = _train(
        tmp_path,
        2,
        "--per-rank-batch",
        "16",
        "--lr-scaling",
        "linear",
        "--warmup-epochs",
        "1",
        "--epochs",
        "3",
        "--lr",
        "0.005",
        "--dtype",
        "float32",
    )
    epochs = [r for r in records if r["event"] == "epoch"]
    assert records[-1]["global_batch"] == 32
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    assert epochs[-1]["lr"] == pytest.approx(0.01)  # 0.005 x 2 ranks after warmup


def test_auto_shares_memory_on_one_node(tmp_path):
    _, records = _train(tmp_path, 2)
    assert records[-1]["comm"] == "mpi-shm"
    # 70 x (784 + 96 + 96 + 700 + 700 + 10) activations > 150,010 parameters
    assert records[-1]["update"] == "shared gradients"
    _, small = _train(tmp_path, 2, "--batch-size", "62", name="small")  # 147,932 < 150,010
    assert small[-1]["update"] == "shared activations"


@pytest.mark.parametrize("share", ["activations", "gradients"])
def test_two_nodes_of_two_ranks_compute_the_same_run(tmp_path, share):
    """XPNN_RANKS_PER_NODE=2 makes 4 ranks two 'nodes': shared memory inside each, and the
    slices allreduced between them (the multi-node path, on one machine)."""
    one, _ = _train(tmp_path, 1)
    four, rec4 = _train(
        tmp_path, 4, "--node-share", share, env={"XPNN_RANKS_PER_NODE": "2"}, name=share
    )
    _assert_close(one, four)
    assert rec4[-1]["comm"] == "mpi-shm" and rec4[-1]["world_size"] == 4
    assert rec4[-1]["update"] == f"shared {share}"


def test_uneven_nodes_fall_back_to_host_buffers_or_refuse(tmp_path):
    uneven = {"XPNN_RANKS_PER_NODE": "2"}  # 3 ranks: nodes of 2 and 1
    one, _ = _train(tmp_path, 1)
    three, rec3 = _train(tmp_path, 3, env=uneven)
    _assert_close(one, three)
    assert rec3[-1]["comm"] == "mpi-host"
    proc = run_xpnn([*BASE, "--comm", "mpi-shm"], ranks=3, env=uneven)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--comm mpi-shm: nodes hold different numbers" in lines[0]


@pytest.mark.parametrize("value", ["abc", "0"])
def test_a_bad_ranks_per_node_override_is_one_line_exit_2(value):
    proc = run_xpnn([*BASE, "--comm", "mpi-shm"], ranks=2, env={"XPNN_RANKS_PER_NODE": value})
    assert_one_line_user_error(proc, f"XPNN_RANKS_PER_NODE={value}: expected a positive integer")


def test_full_shared_memory_is_a_one_line_error_not_a_crash(tmp_path):
    """A /dev/shm too small for the segments (Docker's 64 MiB) would end in SIGBUS on the first
    write; xpnn checks the free space first. The check is fed a nearly full /dev/shm here."""
    launcher = tmp_path / "full_shm.py"
    launcher.write_text(
        "import sys\n"
        "import xpnn.parallel.comm.shm as shm\n"
        "shm.shm_free_bytes = lambda path=shm.SHM_DIR: 4096\n"
        "from xpnn.commands.cli import main\n"
        "sys.exit(main())\n"
    )
    cmd = [mpiexec_path(), "-n", "2", sys.executable, str(launcher), *BASE, "--comm", "mpi-shm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "--comm mpi-shm: needs" in lines[0] and "/dev/shm has 0.0 MiB free" in lines[0]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("share", ["gradients", "activations"])
def test_resume_on_shared_memory_continues_the_same_run(tmp_path, share):
    flags = ["--node-share", share]
    whole, _ = _train(tmp_path, 2, *flags, name="whole")
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    _train(tmp_path, 2, *flags, "--epochs", "1", *ckpt, name="first")
    resumed, records = _train(tmp_path, 2, *flags, *ckpt, "--resume", name="second")
    _assert_close(whole, resumed)
    assert records[-1]["comm"] == "mpi-shm" and records[-1]["update"] == f"shared {share}"
