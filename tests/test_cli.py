"""The command-line contract: flags, exit codes, the metrics file, saved parameters, info."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    ROOT,
    assert_one_line_user_error,
    run_locked_out,
    run_with_stdout_closed,
    run_xpnn,
    xpnn_cmd,
)

from xpnn.errors import UserError, path_problems

SMALL = [
    "--dataset",
    "synthetic",
    "--synthetic-size",
    "600",
    "--hidden",
    "16",
    "--epochs",
    "2",
    "--batch-size",
    "50",
    "--no-progress",
    "--backend",
    "numpy",
]


def _one_error_line(proc, *needles):
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in lines[0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--epochs", "0"], "--epochs"),
        (["--epochs", "two"], "--epochs"),
        (["--backend", "tpu"], "--backend"),
        (["--hidden", "12,x"], "--hidden"),
        (["--batch-size", "0"], "--batch-size"),
        (["--lr", "-1"], "--lr"),
        (["--threads", "0"], "--threads"),
        (["--no-such-flag"], "--no-such-flag"),
        (["--resume"], "--resume"),
        (["--metrics", "/no/such/dir/m.jsonl"], "--metrics"),
        (["--data-dir", "/no/such/dir", "--dataset", "mnist"], "/no/such/dir"),
        (["--hidden", "16,,8"], "--hidden"),  # a typo, not 16,8
        (["--lr", "nan"], "--lr"),
        (["--lr", "0"], "--lr: must be > 0"),
        (["--lr", "inf"], "--lr: must be finite"),
        (["--lr", "abc"], "--lr: not a number: 'abc'"),
        (["--batch-size", "abc"], "--batch-size: expected a number or 'full'"),
        (["--hidden", "2000000000"], "--hidden 2000000000: the network does not fit"),
        (["--hidden", "99999999999999999999"], "--hidden: sizes must be at most 2147483647"),
        (["--threads", "99999999999999"], "--threads: must be at most 4096"),  # was ctypes'
        (["--synthetic-size", "99999999999999999999"], "--synthetic-size: must be at most"),
        (["--replicate", "100000000"], "with --replicate 100000000: the data set does not fit"),
        (["--batch-size", "64", "--per-rank-batch", "32"], "--batch-size and --per-rank-batch"),
        (["--checkpoint-dir", ""], "--checkpoint-dir: empty path"),  # was: no checkpoints
        (["--save", ""], "--save: empty path"),
        (["--save", "/dev/null"], "--save /dev/null: exists and is not a regular file"),
        (
            ["--save", "/tmp/xpnn-same.out", "--metrics", "/tmp/xpnn-same.out"],
            "--save /tmp/xpnn-same.out: the same file as --metrics",
        ),
        (["--bucket-mb", "inf"], "--bucket-mb: must be finite"),  # was an OverflowError
        (["--bucket-mb", "0"], "--bucket-mb: must be >= 0.001"),  # was one value per allreduce
        (["--bucket-mb", "1e-7"], "--bucket-mb: must be >= 0.001"),  # as good as hung
        (["--save", "/tmp"], "--save /tmp: is a directory"),  # refused before, not after training
        # places that cannot be written, even by root, are found before training too
        (["--save", "/proc/m.npz"], "--save /proc/m.npz: cannot create files in /proc"),
        (["--metrics", "/proc/m.jsonl"], "--metrics /proc/m.jsonl: cannot create files in"),
        (["--checkpoint-dir", "/proc/ck"], "--checkpoint-dir /proc/ck: cannot create the dir"),
        (
            ["--checkpoint-dir", "/etc/hostname"],
            "--checkpoint-dir /etc/hostname: exists and is not",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle):
    _one_error_line(run_xpnn([*SMALL, *args], timeout=120), needle)


@pytest.mark.parametrize(
    ("flag", "name", "extra"),
    [
        ("--save", "m.npz", []),
        ("--metrics", "m.jsonl", []),
        ("--checkpoint-dir", "ck", []),
        ("--checkpoint-dir", "ck", ["--resume"]),
        ("--data-dir", "data", ["--dataset", "mnist"]),
    ],
)
def test_a_path_this_user_may_not_look_at(tmp_path, flag, name, extra):
    """Under a directory the user may not enter, even ``Path.exists()`` raises: one line
    naming the flag, exit 2, not ``xpnn: PermissionError: ...``, exit 1, as if it were a bug."""
    locked = tmp_path / "locked"
    (locked / name).mkdir(parents=True)  # there, but out of reach
    path = str(locked / name)
    proc = run_locked_out(["-m", "xpnn", *SMALL, flag, path, *extra], locked)
    _one_error_line(proc, f"xpnn: {flag} {path}: ")


def test_stdout_closed_by_its_reader_stops_in_one_line():
    """``python -m xpnn ... | head -1``: the reader goes away, and the next print fails. It
    stops as a program that SIGPIPE ended (141), saying why, not ``xpnn: BrokenPipeError:
    [Errno 32] Broken pipe``, exit 1, as a bug would."""
    code, err = run_with_stdout_closed(["-m", "xpnn", *SMALL])
    assert code == 141, err
    assert err == "xpnn: stdout was closed (broken pipe): stopped\n"


def _run_python(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)


# ``python -m xpnn`` on a disk that fills up: every np.savez fails as a full disk does
DISK_FULL = """
import sys
import numpy as np
from xpnn.commands.cli import main

def full(*args, **kwargs):
    raise OSError(28, "No space left on device")

np.savez = full
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("flag", ["--save", "--checkpoint-dir", "--metrics"])
def test_a_full_disk_names_the_flag(tmp_path, flag):
    """The flag and the file are named, not ``xpnn: OSError: [Errno 28] No space left on
    device``, exit 1. ``--metrics`` writes to /dev/full, a real full disk."""
    if flag == "--metrics":
        path = "/dev/full"
        cmd = [sys.executable, "-m", "xpnn", *SMALL, flag, path]
    else:
        path = str(tmp_path / ("m.npz" if flag == "--save" else "ck"))
        cmd = [sys.executable, "-c", DISK_FULL, *SMALL, flag, path]
    proc = _run_python(cmd)
    _one_error_line(proc, f"xpnn: {flag} {path}: No space left on device")
    assert not list(tmp_path.glob("**/*.tmp"))  # no half-written file left beside


# A training step whose arrays do not fit (``--model cnn --batch-size full`` under ``ulimit -v``):
# a user error naming the batch, not "xpnn: MemoryError: Unable to allocate 4.84 GiB ...", exit 1
OUT_OF_MEMORY = """
import sys
from xpnn.commands.cli import main
from xpnn.nn.sequential import Sequential

def too_big(*args, **kwargs):
    raise MemoryError("Unable to allocate 4.84 GiB for an array")

Sequential.loss_and_grads = too_big
sys.exit(main(sys.argv[1:]))
"""


def test_a_step_out_of_memory_names_the_batch():
    proc = _run_python([sys.executable, "-c", OUT_OF_MEMORY, *SMALL])
    _one_error_line(
        proc,
        "xpnn: --batch-size 50: a training step ran out of memory (Unable to allocate 4.84 GiB "
        "for an array); try a smaller batch",
    )


def test_path_problems_name_the_parameter_and_the_path_refused():
    """The library names the parameter (and carries it); the command line says its flag."""
    from xpnn.commands.flags import flag_words

    with pytest.raises(UserError, match=r"^`save` /a/b\.npz: Permission denied$") as caught:
        with path_problems("save", "/a/b.npz"):
            raise PermissionError(13, "Permission denied", "/a/b.npz")
    assert caught.value.param == "save"
    assert flag_words(str(caught.value)) == "--save /a/b.npz: Permission denied"
    with pytest.raises(
        UserError, match=r"^`data_dir` /a: Permission denied \(/a/x\.gz\)$"
    ) as caught:
        with path_problems("data_dir", "/a"):
            raise PermissionError(13, "Permission denied", "/a/x.gz")
    assert flag_words(str(caught.value)) == "--data-dir /a: Permission denied (/a/x.gz)"
    with path_problems("save", "/a"):  # nothing refused, nothing raised
        pass


def _strict_json(line: str) -> dict:
    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(line, parse_constant=refuse)


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_diverging_run_stops_after_its_epoch_and_saves_nothing(tmp_path, ranks):
    """--lr 1e30 turns the loss into NaN in epoch 1: the run stops there with one line (no
    NumPy warnings), exit 1, on every rank; no checkpoint or --save file holds NaN, and the
    metrics file stays strict JSON (null, not NaN) and says what happened."""
    metrics, saved, ckpt = tmp_path / "m.jsonl", tmp_path / "p.npz", tmp_path / "ck"
    args = [*SMALL, "--epochs", "3", "--lr", "1e30", "--metrics", str(metrics)]
    args += ["--save", str(saved), "--checkpoint-dir", str(ckpt), "--backend", "numpy"]
    proc = run_xpnn(args, ranks=ranks, timeout=120)
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "diverged in epoch 1" in lines[0] and "--lr" in lines[0], lines
    assert not saved.exists() and list(ckpt.iterdir()) == []
    records = [_strict_json(line) for line in metrics.read_text().splitlines()]
    assert [r["event"] for r in records] == ["epoch", "diverged"]
    assert records[0]["train_loss"] is None and records[1]["epoch"] == 1


@pytest.mark.parametrize("flag", ["--epochs", "--bucket-mb", "--hidden"])
def test_a_bad_value_names_its_flag_once(flag):
    proc = run_xpnn([*SMALL, flag, "-1"], timeout=120)
    _one_error_line(proc, flag)
    assert proc.stderr.count(flag) == 1, proc.stderr


@pytest.mark.parametrize(
    ("ranks", "comm", "noted"), [(1, "auto", True), (2, "mpi-shm", True), (2, "mpi-host", False)]
)
def test_bucket_mb_says_when_it_has_no_effect(ranks, comm, noted):
    """One process and mpi-shm cut buckets at layers; a --bucket-mb given there says so."""
    proc = run_xpnn([*SMALL, "--comm", comm, "--bucket-mb", "1"], ranks=ranks, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert ("--bucket-mb has no effect" in proc.stderr) is noted, proc.stderr
    assert "--bucket-mb has no effect" not in run_xpnn(SMALL, timeout=120).stderr


@pytest.mark.parametrize(
    ("ranks", "comm", "noted"), [(1, "auto", True), (2, "mpi-host", True), (2, "mpi-shm", False)]
)
def test_node_share_says_when_it_has_no_effect(ranks, comm, noted):
    """Only ranks that share a node's memory choose what to share."""
    proc = run_xpnn([*SMALL, "--comm", comm, "--node-share", "gradients"], ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    assert ("--node-share has no effect" in proc.stderr) is noted, proc.stderr


def test_node_share_activations_refuses_a_cnn_in_one_line():
    args = ["--model", "cnn", "--dataset", "synthetic", "--synthetic-size", "40", "--epochs", "1"]
    proc = run_xpnn([*args, "--node-share", "activations", "--no-progress"], ranks=2)
    assert_one_line_user_error(
        proc,
        "--node-share activations: needs a model whose layers with parameters are all "
        "Dense, this one has Conv2D",
    )


@pytest.mark.parametrize("parallel", ["tensor", "pipeline"])
def test_bucket_mb_under_model_parallelism_says_no_gradients_are_exchanged(parallel):
    proc = run_xpnn([*SMALL, "--parallel", parallel, "--bucket-mb", "1"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"--bucket-mb has no effect with --parallel {parallel}" in proc.stderr


@pytest.mark.parametrize("flags", [["--hidden", "64"], ["--activation", "tanh"]])
def test_mlp_flags_say_they_have_no_effect_on_the_cnn(flags):
    args = ["--model", "cnn", "--dataset", "synthetic", "--synthetic-size", "40", "--epochs", "1"]
    proc = run_xpnn([*args, *flags, "--no-progress"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"note: {flags[0]} has no effect with --model cnn" in proc.stderr
    assert "has no effect" not in run_xpnn([*SMALL, *flags], timeout=120).stderr  # the MLP


def test_bucket_mb_help_states_the_default_used():
    from xpnn.commands.flags import build_parser
    from xpnn.parallel.update import DEFAULT_BUCKET_MB

    help_text = " ".join(build_parser().format_help().split())
    assert f"(default {DEFAULT_BUCKET_MB:g};" in help_text


def test_cupy_without_cupy_or_gpu_is_one_line_exit_2():
    pytest.importorskip("numpy")
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a CUDA device is present: --backend cupy is expected to work here")
    except Exception:
        pass
    _one_error_line(run_xpnn([*SMALL, "--backend", "cupy"]), "--backend cupy")


def test_bad_flag_under_mpiexec_is_printed_once():
    proc = run_xpnn([*SMALL, "--epochs", "0"], ranks=2, timeout=120)
    _one_error_line(proc, "--epochs")


def test_metrics_file_and_saved_parameters(tmp_path):
    metrics, saved = tmp_path / "m.jsonl", tmp_path / "p.npz"
    proc = run_xpnn([*SMALL, "--metrics", str(metrics), "--save", str(saved)])
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["event"] for r in records] == ["epoch", "epoch", "done"]
    for r in records[:2]:
        for key in (
            "epoch",
            "train_loss",
            "test_loss",
            "test_acc",
            "seconds",
            "samples_per_s",
            "world_size",
            "backend",
            "comm",
        ):
            assert key in r, key
    assert records[1]["train_loss"] < records[0]["train_loss"]
    done = records[-1]
    assert done["epochs"] == 2 and done["world_size"] == 1 and done["comm"] == "self"
    assert done["params"] == 784 * 16 + 16 + 16 * 10 + 10
    with np.load(saved, allow_pickle=False) as params:
        assert sorted(params.files) == ["layer0.W", "layer0.b", "layer1.W", "layer1.b"]
        assert params["layer0.W"].shape == (784, 16)
    assert "epoch 1/2" in proc.stdout and "comm self" in proc.stdout


def test_resume_continues_the_same_run(tmp_path):
    whole, resumed = tmp_path / "whole.npz", tmp_path / "resumed.npz"
    base = [*SMALL, "--dtype", "float64"]
    assert run_xpnn([*base, "--save", str(whole)]).returncode == 0
    ckpt = tmp_path / "ckpt"
    first = run_xpnn([*base, "--epochs", "1", "--checkpoint-dir", str(ckpt)])
    assert first.returncode == 0, first.stderr
    assert [p.name for p in ckpt.iterdir()] == ["checkpoint-epoch0001.npz"]
    second = run_xpnn([*base, "--checkpoint-dir", str(ckpt), "--resume", "--save", str(resumed)])
    assert second.returncode == 0, second.stderr
    assert "resume:" in second.stdout
    with np.load(whole) as a, np.load(resumed) as b:
        for name in a.files:
            np.testing.assert_allclose(b[name], a[name], rtol=1e-12)


def test_full_batch_gradient_descent():
    proc = run_xpnn([*SMALL, "--batch-size", "full", "--optimizer", "sgd", "--lr", "0.5"])
    assert proc.returncode == 0, proc.stderr
    assert "global batch 600" in proc.stdout


def test_info_lists_backends_and_mpi():
    proc = run_xpnn(["info"])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "numpy  available" in out and "numba  available" in out
    assert "cupy" in out and "MPI:" in out and "CUDA-aware:" in out
    proc = run_xpnn(["info", "--json"])
    data = json.loads(proc.stdout)
    assert data["mpi"]["cuda_aware"] is False  # the mpich wheel is built without CUDA


def test_info_under_mpiexec_prints_once_and_refuses_a_bad_flag():
    proc = run_xpnn(["info"], ranks=2, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("backends:") == 1 and "ranks: 2 (2 on this node)" in proc.stdout
    _one_error_line(run_xpnn(["info", "--bogus"], timeout=120), "unrecognized arguments: --bogus")


def test_progress_bar_only_on_a_terminal():
    """tqdm draws on stderr when stderr is a terminal (a pty here), and not into a pipe."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    from conftest import ROOT

    args = [a for a in SMALL if a != "--no-progress"]
    leader, follower = pty.openpty()
    # A new pty is 0x0; tqdm sizes its bar to the terminal and draws nothing in 0 columns.
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    proc = subprocess.run(
        [sys.executable, "-m", "xpnn", *args],
        stdout=subprocess.PIPE,
        stderr=follower,
        cwd=ROOT,
        timeout=120,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the pty is closed and drained
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.returncode == 0
    assert b"batch" in b"".join(chunks)  # tqdm's unit, e.g. "12/12 [00:00, 300batch/s]"
    piped = run_xpnn(args)
    assert piped.returncode == 0 and "batch/s" not in piped.stderr


@pytest.mark.parametrize(
    ("extra", "factors"), [([], [1, 0.1, 0.01]), (["--step-epochs", "2"], [1, 1, 0.1])]
)
def test_the_step_schedule_decays_by_epochs_not_steps(tmp_path, extra, factors):
    """x0.1 every --step-epochs epochs (default a third of the run); each epoch's line logs the
    rate of its last step. It once decayed at every step: 1e-12 after the first epoch."""
    metrics = tmp_path / "m.jsonl"
    args = [*SMALL, "--epochs", "3", "--lr", "0.01", "--schedule", "step", *extra]
    proc = run_xpnn([*args, "--metrics", str(metrics)])
    assert proc.returncode == 0, proc.stderr
    epochs = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["event"] == "epoch"]
    assert [r["lr"] for r in epochs] == pytest.approx([0.01 * f for f in factors], rel=1e-12)


def test_ctrl_c_while_setting_up_is_interrupted_not_a_traceback():
    """SIGINT while the data set is made (after Numba is loaded, before training): one line,
    exit 130. It was a KeyboardInterrupt traceback, then death by SIGINT."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT

    proc = subprocess.Popen(
        [sys.executable, "-m", "xpnn", *SMALL, "--backend", "numba", "--synthetic-size", "100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # see test_data_parallel
    )
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 60
    while "llvmlite" not in maps.read_text():  # the backend is built: the data set is next
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert "xpnn: synthetic" not in out, "the signal came after the setup it was meant for"
    assert proc.returncode == 130, err
    assert err.strip() == "xpnn: interrupted" and "Traceback" not in err


def test_settings_that_are_probably_a_slip_get_a_note():
    from xpnn.runtime.threads import node_cores

    more = node_cores() + 1  # one thread more than this machine's cores
    proc = run_xpnn([*SMALL, "--epochs", "1", "--warmup-epochs", "2", "--threads", str(more)])
    assert proc.returncode == 0, proc.stderr
    assert "--warmup-epochs 2 is longer than the run (--epochs 1)" in proc.stderr
    assert f"--threads {more} but this rank has {more - 1} core(s) of its own" in proc.stderr
    quiet = run_xpnn([*SMALL, "--epochs", "1", "--threads", "1"])
    assert quiet.returncode == 0 and "note" not in quiet.stderr, quiet.stderr


@pytest.mark.mpi
def test_more_ranks_than_cores_get_a_note_once():
    """Two ranks on one CPU (``taskset``, whatever the machine's size)."""
    import os

    one_cpu = ["taskset", "-c", str(min(os.sched_getaffinity(0)))]
    proc = subprocess.run(
        [*one_cpu, *xpnn_cmd([*SMALL, "--epochs", "1"], ranks=2)],
        capture_output=True, text=True, timeout=300, cwd=ROOT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    note = "xpnn: note: 2 ranks on this node share fewer cores than there are ranks"
    assert proc.stderr.count(note) == 1, proc.stderr  # said by rank 0 alone


def test_the_default_backend_is_auto_and_the_header_says_what_it_took():
    """Without --backend a CPU-only machine trains on Numba's kernels, not plain NumPy."""
    from xpnn.backends import accelerator_possible

    args = [a for a in SMALL if a not in ("--backend", "numpy")]
    proc = run_xpnn([*args, "--epochs", "1"])
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.splitlines()[1]
    assert "(auto, " in header and "backend numpy" not in header, header
    if not accelerator_possible():
        assert "backend numba (auto, cpu, float32)" in header, header


def test_auto_without_an_accelerator_takes_numba_without_importing_torch():
    """Importing PyTorch costs each rank a second or more: not done where no device is."""
    code = (
        "import sys, xpnn.backends as b; b.accelerator_possible = lambda: False; "
        "print(b.auto_without_cupy(), 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.split() == ["numba", "False"], out.stderr


def test_version_and_info_say_the_version():
    from xpnn.commands.cli import xpnn_version

    proc = run_xpnn(["--version"])
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"xpnn {xpnn_version()}\n", "")
    info = run_xpnn(["info"])
    assert info.returncode == 0 and info.stdout.splitlines()[0] == f"xpnn {xpnn_version()}"


def test_the_version_falls_back_to_the_packages(monkeypatch):
    """A clone on PYTHONPATH, not installed: importlib.metadata knows no xpnn."""
    import importlib.metadata

    import xpnn
    from xpnn.commands.cli import xpnn_version

    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", absent)
    assert xpnn_version() == xpnn.__version__
