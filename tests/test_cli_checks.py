"""What the command line refuses, notes or guards: cases found by running xpnn as a demanding
user would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    ROOT,
    _without_root_rights,
    assert_one_line_user_error,
    mpiexec_path,
    run_with_stdout_closed,
    run_xpnn,
)

# 600 samples in batches of 50: 12 steps an epoch (so are batches of 52, and 599 samples)
SMALL = [
    "--dataset", "synthetic", "--synthetic-size", "600", "--hidden", "16", "--epochs", "1",
    "--batch-size", "50", "--no-progress", "--backend", "numpy",
]  # fmt: skip


def _refused(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        # 2**64 was taken, then written into the checkpoint as a pickled object, which no
        # --resume could read back
        (["--seed", str(2**64)], "--seed: must be from 0 to 2**64 - 1, got 18446744073709551616"),
        # epochs x steps went past what an int holds: "OverflowError: cannot convert float
        # infinity to integer", exit 1
        (["--warmup-epochs", "1e308"], "--warmup-epochs: must be at most 2147483647"),
        (["--bucket-mb", "1e300"], "--bucket-mb: must be at most 1048576"),
        (["--save", "README.md/m.npz"], "--save README.md/m.npz: README.md is not a directory"),
        (["--metrics", "README.md/m.jsonl"], "README.md is not a directory"),
    ],
)
def test_values_that_failed_later_are_refused_up_front(args, needle):
    _refused(run_xpnn([*SMALL, *args], timeout=120), needle)


def test_the_largest_seed_checkpoints_and_resumes(tmp_path):
    seed = ["--seed", str(2**64 - 1), "--checkpoint-dir", str(tmp_path / "ck")]
    assert run_xpnn([*SMALL, *seed]).returncode == 0
    proc = run_xpnn([*SMALL, *seed, "--epochs", "2", "--resume"])
    assert proc.returncode == 0, proc.stderr
    assert "resume: " in proc.stdout and "(epoch 1, step 12)" in proc.stdout


def test_a_pipe_as_metrics_is_refused_not_waited_on(tmp_path):
    """xpnn opened the file for each line: a reader (``cat fifo``) left at the first line's
    end, and the next line waited for another reader forever (and with no reader at all, the
    emptying at the start did)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc = run_xpnn([*SMALL, "--metrics", str(fifo)], timeout=60)
    _refused(proc, f"--metrics {fifo}: is a pipe or a socket; give a file name")


def test_a_refused_run_leaves_the_metrics_file_alone(tmp_path):
    """A run refused after the setup's checks (here: the communicator) used to find an emptied
    file: the emptying came first."""
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"event": "done"}\n')
    proc = run_xpnn([*SMALL, "--metrics", str(metrics), "--comm", "nccl"], timeout=120)
    _refused(proc, "--comm nccl: needs --backend cupy")
    assert metrics.read_text() == '{"event": "done"}\n'


def test_a_resume_that_starts_afresh_starts_a_fresh_metrics_file(tmp_path):
    """``--resume auto`` with no checkpoint yet appended to whatever run the file held before."""
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"event": "done", "from": "another run"}\n')
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--resume", "auto", "--metrics", str(metrics)]
    proc = run_xpnn([*SMALL, *ck])
    assert proc.returncode == 0, proc.stderr
    assert "starting afresh" in proc.stdout
    assert "another run" not in metrics.read_text()
    assert len(metrics.read_text().splitlines()) == 2  # its epoch and its end
    proc = run_xpnn([*SMALL, *ck, "--epochs", "2"])  # a real resume appends
    assert proc.returncode == 0, proc.stderr
    assert len(metrics.read_text().splitlines()) == 4


def test_a_read_only_metrics_file_is_refused_before_training(tmp_path):
    """One line and exit 2 before the first epoch, not ``xpnn: PermissionError: ...`` and exit 1
    after it (with --resume, an epoch lost)."""
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("")
    metrics.chmod(0o444)
    cmd = [*_without_root_rights(), sys.executable, "-m", "xpnn", *SMALL, "--metrics", str(metrics)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    _refused(proc, f"--metrics {metrics}: cannot write to it (Permission denied)")
    assert "epoch 1" not in proc.stdout


@pytest.mark.parametrize("ranks", [1, 2])
def test_outputs_may_go_into_the_checkpoint_directory_the_run_makes(tmp_path, ranks):
    """``--checkpoint-dir run1 --save run1/final.npz --metrics run1/m.jsonl`` on a fresh run
    said ``directory run1 does not exist``: it was checked before the run made it. On 2 ranks
    the rank that does not make it must not check it either."""
    run = tmp_path / "run1"
    out = ["--checkpoint-dir", str(run), "--save", str(run / "final.npz")]
    proc = run_xpnn([*SMALL, *out, "--metrics", str(run / "m.jsonl")], ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    assert {p.name for p in run.iterdir()} == {"checkpoint-epoch0001.npz", "final.npz", "m.jsonl"}


def test_a_killed_runs_half_written_checkpoint_is_removed(tmp_path):
    """SIGKILL while rank 0 wrote a checkpoint left its temporary file (42 MB in the report)
    for good: nothing removed it."""
    ck = tmp_path / "ck"
    assert run_xpnn([*SMALL, "--checkpoint-dir", str(ck)]).returncode == 0
    left = ck / "checkpoint-epoch0002.npz.k1x_9q2b.tmp"
    left.write_bytes(b"half a checkpoint")
    other = ck / "notes.tmp"  # not ours
    other.write_text("keep")
    proc = run_xpnn([*SMALL, "--checkpoint-dir", str(ck), "--resume", "--epochs", "2"])
    assert proc.returncode == 0, proc.stderr
    assert not left.exists() and other.exists()


def test_a_killed_runs_half_written_save_is_removed(tmp_path):
    """The same for --save: SIGKILL while rank 0 wrote final.npz left final.npz.*.tmp."""
    save = tmp_path / "final[1].npz"  # glob characters in the name are taken as they are
    left = tmp_path / "final[1].npz.k1x_9q2b.tmp"
    left.write_bytes(b"half a file")
    others = [tmp_path / "final1.npz.k1x_9q2b.tmp", tmp_path / "other.npz.a.tmp"]
    for other in others:
        other.write_text("keep")
    proc = run_xpnn([*SMALL, "--save", str(save)])
    assert proc.returncode == 0, proc.stderr
    assert save.exists() and not left.exists() and all(p.exists() for p in others)


def test_save_may_not_take_a_checkpoints_name(tmp_path):
    """It replaced the checkpoint with bare parameters, which the next --resume refused."""
    ck = tmp_path / "ck"
    proc = run_xpnn(
        [*SMALL, "--checkpoint-dir", str(ck), "--save", str(ck / "checkpoint-epoch0001.npz")]
    )
    _refused(proc, "a name --checkpoint-dir uses for the run's checkpoints")


@pytest.mark.parametrize(
    ("changed", "needle"),
    [
        (["--batch-size", "52"], "with global batch 50, this one has global batch 52"),
        (["--activation", "tanh"], "with --activation relu, this one has --activation tanh"),
        (
            ["--loss", "sigmoid_bce"],
            "--loss softmax_cross_entropy, this one has --loss sigmoid_bce",
        ),
        (
            ["--synthetic-size", "599"],
            "with training set size 600, this one has training set size 599",
        ),
    ],
)
def test_resume_refuses_another_batch_network_or_data_set_size(tmp_path, changed, needle):
    """Each of these makes as many steps an epoch, so the step count did not tell them apart:
    the resume went on silently with other batches or another network."""
    ck = ["--checkpoint-dir", str(tmp_path / "ck")]
    assert run_xpnn([*SMALL, *ck]).returncode == 0
    proc = run_xpnn([*SMALL, *ck, "--epochs", "2", "--resume", *changed])
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr


@pytest.mark.parametrize(
    ("args", "note"),
    [
        (["--data-dir", "/usr/share"], "--data-dir has no effect with --dataset synthetic"),
        (["--comm", "mpi-host"], "--comm mpi-host has no effect on 1 rank"),
    ],
)
def test_ignored_flags_say_so(args, note):
    proc = run_xpnn([*SMALL, *args])
    assert proc.returncode == 0, proc.stderr
    assert f"xpnn: note: {note}" in proc.stderr


@pytest.mark.parametrize(
    ("variable", "value", "needle"),
    [
        # the stuck-rank watch thread died in its sleep with a traceback, on SIGTERM
        ("XPNN_STOP_GRACE", "-5", "XPNN_STOP_GRACE=-5: expected a number of seconds >= 0"),
        ("XPNN_STOP_GRACE", "inf", "XPNN_STOP_GRACE=inf: expected a number of seconds >= 0"),
        ("XPNN_FAIL_AT", "abc", "XPNN_FAIL_AT=abc: expected RANK:STEP"),  # was a ValueError, 1
        # read only when a rank fails, where its own error replaced the real one
        ("XPNN_AGREE_TIMEOUT", "abc", "XPNN_AGREE_TIMEOUT=abc: expected a number of seconds"),
    ],
)
def test_a_bad_xpnn_variable_is_one_line_before_training(variable, value, needle):
    proc = run_xpnn(SMALL, env={variable: value})
    _refused(proc, needle)
    assert "epoch 1" not in proc.stdout


def test_a_thread_variable_the_run_overrides_is_noted():
    """``OMP_NUM_THREADS`` replaced by the default (the cores) is said, not done silently."""
    proc = run_xpnn(SMALL, env={"OMP_NUM_THREADS": "97"})  # not this machine's cores
    assert proc.returncode == 0, proc.stderr
    assert "xpnn: note: OMP_NUM_THREADS=97 in the environment: xpnn uses" in proc.stderr
    quiet = run_xpnn([*SMALL, "--threads", "2"], env={"OMP_NUM_THREADS": "97"})
    assert "OMP_NUM_THREADS" not in quiet.stderr  # --threads chose


def test_synthetic_size_without_synthetic_data_says_so(fashion_dir):
    args = ["--data-dir", str(fashion_dir), "--synthetic-size", "5", "--hidden", "8"]
    proc = run_xpnn([*args, "--epochs", "1", "--batch-size", "full", "--no-progress"])
    assert proc.returncode == 0, proc.stderr
    assert "note: --synthetic-size has no effect with --dataset fashion-mnist" in proc.stderr


def test_help_names_info_and_the_defaults():
    from xpnn.commands.flags import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "python -m xpnn info" in text
    for default in ("(default auto: ", "(default 5)", "(default 0.001)", "(default adam)"):
        assert default in text, default
    assert "(default float32)" in text and "(default fashion-mnist;" in text


def test_help_gives_every_flags_default():
    """--schedule, --lr-scaling, --parallel and --replicate gave none, though the README
    sends readers to --help for the defaults."""
    from xpnn.commands.flags import build_parser

    for action in build_parser()._actions:
        if action.option_strings and action.default not in (None, False, "==SUPPRESS=="):
            text, value = " ".join(action.help.split()), action.default
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            assert "default" in text and shown in text, action.dest


def test_info_with_stdout_gone_or_full_is_one_line():
    """One line each, not a BrokenPipeError or ``OSError: [Errno 28]`` traceback."""
    code, err = run_with_stdout_closed(["-m", "xpnn", "info"])
    assert (code, err) == (141, "xpnn: stdout was closed (broken pipe): stopped\n")
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "xpnn", "info"], stdout=full, stderr=subprocess.PIPE, text=True,
            cwd=ROOT, timeout=120,
        )  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    said = "xpnn: OSError: [Errno 28] cannot write to stdout: No space left on device"
    assert proc.stderr.splitlines() == [said]


def test_a_checkpoint_of_strings_is_damaged(tmp_path):
    """Strings parsed into numbers, or complex values cast with a warning, would let training go
    on from garbage: such a checkpoint is refused as damaged."""
    ck = tmp_path / "ck"
    assert run_xpnn([*SMALL, "--checkpoint-dir", str(ck)]).returncode == 0
    path = ck / "checkpoint-epoch0001.npz"
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    arrays["layer0.W"] = arrays["layer0.W"].astype("U8")
    np.savez(path, **arrays)
    proc = run_xpnn([*SMALL, "--checkpoint-dir", str(ck), "--resume", "--epochs", "2"])
    assert proc.returncode == 2, proc.stderr
    assert "damaged checkpoint (layer0.W holds <U8 values, not floating point)" in proc.stderr


# -- several ranks -------------------------------------------------------------------------


def _mpmd(first: list[str], second: list[str], cwd: tuple[Path, Path] | None = None) -> list[str]:
    """``mpiexec -n 1 python -m xpnn FIRST : -n 1 python -m xpnn SECOND``, each rank in its
    own working directory where given."""
    cmd = [mpiexec_path()]
    for i, args in enumerate((first, second)):
        where = ["-wdir", str(cwd[i])] if cwd else []
        cmd += [*([":"] if i else []), "-n", "1", *where, sys.executable, "-m", "xpnn", *args]
    return cmd


def _run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def test_ranks_given_other_flags_are_refused_not_left_waiting():
    """Another --epochs on one rank of an MPMD line: that rank left the last epoch's
    collectives early, and the job hung past SIGTERM."""
    start = time.monotonic()
    proc = _run(_mpmd([*SMALL, "--epochs", "2"], [*SMALL, "--epochs", "3"]))
    assert time.monotonic() - start < 30
    assert_one_line_user_error(
        proc, "--epochs: rank 1 was given 3, rank 0 2; every rank must get the same settings"
    )


def test_ranks_with_other_thread_counts_are_reported_rank_by_rank(tmp_path):
    """--threads may differ between ranks (nodes differ in cores), but the run's line and
    metrics gave rank 0's count as the whole run's."""
    metrics = tmp_path / "m.jsonl"
    proc = _run(
        _mpmd([*SMALL, "--threads", "1", "--metrics", str(metrics)], [*SMALL, "--threads", "2"])
    )
    assert proc.returncode == 0, proc.stderr
    assert "2 rank(s) x 1, 2 thread(s) (rank by rank)" in proc.stdout
    record = json.loads(metrics.read_text().splitlines()[0])
    assert record["threads"] == 1 and record["threads_per_rank"] == [1, 2]
    proc = _run(
        _mpmd([*SMALL, "--threads", "1", "--metrics", str(metrics)], [*SMALL, "--threads", "1"])
    )
    assert proc.returncode == 0, proc.stderr
    assert "2 rank(s) x 1 thread(s)" in proc.stdout
    assert "threads_per_rank" not in json.loads(metrics.read_text().splitlines()[0])


def test_ranks_that_find_other_checkpoints_are_refused(tmp_path):
    """A --checkpoint-dir on each node's own disk: only rank 0 writes it, so on --resume rank 0
    continued from epoch 2 and rank 1 from epoch 1 (or from nothing): a wrong run, then a
    hang."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    ck = ["--checkpoint-dir", "ck"]
    for where, epochs in ((a, "2"), (b, "1")):
        proc = subprocess.run(
            [sys.executable, "-m", "xpnn", *SMALL, *ck, "--epochs", epochs],
            capture_output=True, text=True, timeout=120, cwd=where,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    args = [*SMALL, *ck, "--epochs", "3", "--resume"]
    proc = _run(_mpmd(args, args, (a, b)))
    assert_one_line_user_error(
        proc,
        "--checkpoint-dir ck: the ranks find different latest checkpoints (rank 0: "
        "checkpoint-epoch0002.npz, rank 1: checkpoint-epoch0001.npz)",
    )
    assert not (a / "ck" / "checkpoint-epoch0003.npz").exists()


def test_node_share_activations_under_tensor_parallelism_names_the_reason():
    """It said ``needs a model whose layers with parameters are all Dense, this one has
    ColumnDense, RowDense`` of an all-Dense MLP, after the summary lines."""
    proc = run_xpnn([*SMALL, "--parallel", "tensor", "--node-share", "activations"], ranks=2)
    assert_one_line_user_error(proc, "--node-share activations: only with --parallel data")
    assert proc.stdout == ""


def test_a_bad_ranks_per_node_is_an_error_under_auto_too():
    """``auto`` took it as a reason to fall back to mpi-host, and said nothing."""
    proc = run_xpnn(SMALL, ranks=2, env={"XPNN_RANKS_PER_NODE": "abc"})
    assert_one_line_user_error(proc, "XPNN_RANKS_PER_NODE=abc: expected a positive integer")


def test_auto_says_why_it_settled_for_mpi_host():
    """Uneven nodes (1 and 2 ranks) rule out mpi-shm; auto says so instead of settling silently."""
    proc = run_xpnn([*SMALL, "--threads", "1"], ranks=3, env={"XPNN_RANKS_PER_NODE": "2"})
    assert proc.returncode == 0, proc.stderr
    assert "comm mpi-host" in proc.stdout
    assert (
        "xpnn: note: comm mpi-host: not mpi-shm: nodes hold different numbers of ranks (1, 2)"
        in (proc.stderr)
    )


STOPPED_RANK = """
import os, signal, sys
from xpnn.commands.cli import main
from xpnn.train import Trainer

step = Trainer.step

def step_then_stop(self, batch, i):
    if self.comm.rank == 1 and i == 3:
        print("stopping", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)  # a rank that no longer answers
    return step(self, batch, i)

Trainer.step = step_then_stop
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_ends_a_job_whose_rank_stopped_answering():
    """Rank 0 waits in an allreduce for rank 1, which is stopped: Python runs the SIGTERM
    handler only between bytecodes, so mpiexec's SIGTERM (``timeout``, ``kill``) was ignored
    and the job ran on. A thread the signal wakes ends it ``XPNN_STOP_GRACE`` s later."""
    cmd = [mpiexec_path(), "-n", "2", sys.executable, "-c", STOPPED_RANK, *SMALL, "--epochs", "50"]
    env = {**os.environ, "XPNN_STOP_GRACE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
        cwd=ROOT, env=env,
    )  # fmt: skip
    try:
        assert any(line.strip() == "stopping" for line in proc.stdout)  # ... or at its end
        time.sleep(1)  # rank 0 is in its allreduce by now
        proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        out, err = proc.communicate(timeout=30)
        assert time.monotonic() - start < 15
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "rank 0: terminated (SIGTERM), and still not stopped after 1 s" in err, err


def test_say_writes_a_line_in_one_write(monkeypatch):
    """``print`` sent the text and its newline apart (stderr writes through): two ranks' lines
    ran together, ``rank 1: interruptedrank 0: interrupted``."""
    from xpnn.runtime import failure

    writes: list[str] = []

    class Recorder:
        def write(self, text: str) -> None:
            writes.append(text)

        def flush(self) -> None:
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    failure.say("rank 1: interrupted")
    assert writes == ["rank 1: interrupted\n"]
