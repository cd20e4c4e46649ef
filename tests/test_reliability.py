"""A week-long job on a shared cluster, under a real ``mpiexec``: one job per checkpoint
directory, no hang when some ranks fail at start-up, clean ends on every stop signal (the final
save included), checkpoint-and-exit on request, and a metrics file that records each epoch once.
Cases that need no second rank run in the process. With ``XPNN_FAULT_LOG`` each case writes a
line for docs/reliability.md's table."""

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
from conftest import ROOT, TINY_FLOAT64_RUN, mpiexec_path, run_xpnn
from faults import Job, left_behind, rank_pids, record, snapshot, wait_for_write, writing

from xpnn.runtime import lock
from xpnn.train import metrics_file
from xpnn.train.checkpoint import (
    CHECKPOINT_NAME,
    DamagedCheckpoint,
    atomic_savez,
    checkpoints,
    read_npz,
    remove_unfinished,
    save_checkpoint,
)

ARGS = [*TINY_FLOAT64_RUN, "--hidden", "16"]
LONG = [*ARGS, "--epochs", "100000"]
XPNN = [sys.executable, "-m", "xpnn"]


def _mpmd(first: list[str], second: list[str], env: dict | None = None) -> tuple:
    """``mpiexec -n 1 FIRST : -n 1 SECOND``: (exit code, stderr, seconds)."""
    start = time.monotonic()
    proc = subprocess.run(
        [mpiexec_path(), "-n", "1", *first, ":", "-n", "1", *second],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    return proc.returncode, proc.stderr, time.monotonic() - start


def _xpnn_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith(("xpnn:", "rank "))]


# ------------------------------------------------------------------ the checkpoint lock


@pytest.mark.mpi
def test_a_second_job_in_a_checkpoint_directory_is_refused_naming_the_holder(tmp_path):
    """Two jobs started together, and a resubmitted ``--resume``: the second is refused in
    one line naming the first (job id, pid, host), which finishes untouched."""
    ck = tmp_path / "ck"
    holder = Job(
        [*ARGS, "--epochs", "2", "--checkpoint-dir", str(ck)],
        env={"XPNN_SAVE_FAULT": "sleep:4", "SLURM_JOB_ID": "4242"},
    )
    wait_for_write(holder, ck)
    for extra in ([], ["--resume"]):
        start = time.monotonic()
        second = run_xpnn([*ARGS, "--checkpoint-dir", str(ck), *extra], timeout=120)
        lines = _xpnn_lines(second.stderr)
        assert second.returncode == 2, second.stderr
        assert len(lines) == 1 and "in use by job 4242, pid" in lines[0], second.stderr
        record(case="lock", moment="second job" + (" --resume" if extra else ""), exit=2,
               seconds=round(time.monotonic() - start, 2), stderr=lines[0])  # fmt: skip
        holders = [holder.proc.pid, *rank_pids(holder.proc.pid).values()]
        assert writing(holders, ck), "the second job cut the first one's checkpoint short"
    code, err, _ = holder.finish(120)
    assert code == 0, err
    assert sorted(p.name for p in ck.iterdir()) == [
        "checkpoint-epoch0001.npz",
        "checkpoint-epoch0002.npz",
    ]  # the lock file went with its holder


def test_a_lock_whose_holder_is_gone_is_taken(tmp_path):
    """A lock file left by a killed job (its words remain, its lock does not) is no obstacle;
    the same process taking it twice is one hold."""
    (tmp_path / lock.LOCK_NAME).write_text('{"host": "h", "pid": 999999999, "job_id": "7"}')
    try:
        lock.hold(tmp_path)
        lock.hold(tmp_path)
        who = json.loads((tmp_path / lock.LOCK_NAME).read_text())
        assert who["pid"] == os.getpid() and who["host"] and who["started"] > 0
        code = f"from xpnn.runtime import lock; lock.hold({str(tmp_path)!r})"
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert other.returncode == 1 and f"pid {os.getpid()} on" in other.stderr
    finally:
        lock.release_all()
    assert not (tmp_path / lock.LOCK_NAME).exists()


def test_the_sweep_of_unfinished_writes_takes_only_its_own_names(tmp_path):
    """A user's ``final.npz.backup.tmp`` stays; a write under way (held open) stays."""
    user = tmp_path / "final.npz.backup.tmp"
    left = tmp_path / "final.npz.abcd1234.tmp"
    open_now = tmp_path / "final.npz.wxyz5678.tmp"
    for path in (user, left, open_now):
        path.write_bytes(b"x")
    with open(open_now, "rb"):
        assert remove_unfinished(tmp_path, "final.npz") == [left]
    assert user.exists() and open_now.exists() and not left.exists()


# ------------------------------------------------------------------------- start-up


@pytest.mark.mpi
def test_a_start_up_failure_on_some_ranks_ends_the_job_at_once(tmp_path):
    """Each would hang for ever in MPI_Init were the failing rank to leave before MPI."""
    train = [*XPNN, *ARGS]
    cases = {
        "a bad flag on rank 1": (train, [*train, "--lr", "nan"], {}, "rank 1: --lr: must be > 0"),
        "info : train": ([*XPNN, "info"], train, {}, "rank 1 runs 'train', rank 0 'info'"),
        "a bad variable on rank 1": (
            train,
            ["env", "XPNN_STOP_GRACE=soon", *train],
            {},
            "rank 1: XPNN_STOP_GRACE=soon",
        ),
        "rank 1 cannot load MPI": (
            train,
            ["env", "MPI4PY_LIBMPI=/nonexistent/libmpi.so", *train],
            {},
            "rank 1: started by an MPI launcher",
        ),
    }
    for case, (first, second, env, said) in cases.items():
        code, err, seconds = _mpmd(first, second, env)
        lines = _xpnn_lines(err)
        record(case="start-up", moment=case, exit=code, seconds=round(seconds, 2), stderr=said)
        assert code == 2, (case, err)
        assert seconds < 30, case
        assert len(lines) == 1 and said in lines[0], (case, err)
        assert "Traceback" not in err


@pytest.mark.mpi
def test_a_rank_that_fails_before_mpi_ends_the_job_with_its_own_line(tmp_path):
    """A ``numpy.py`` that raises on one segment's ``PYTHONPATH``, or ``-h`` in one segment:
    that rank starts MPI anyway and says so in the start-up agreement; nothing is left in
    /dev/shm or /tmp."""
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "numpy.py").write_text("raise ImportError('planted numpy breaks')\n")
    path = f"{planted}{os.pathsep}{os.environ.get('PYTHONPATH', ROOT)}"
    train = [*XPNN, *ARGS]
    cases = {
        "rank 1 cannot import numpy": (
            ["env", f"PYTHONPATH={path}", *train],
            "rank 1: cannot start: ImportError: planted",
        ),
        "-h on rank 1": ([*XPNN, "-h"], "rank 1 runs 'train --help', rank 0 'train'"),
    }
    for case, (second, said) in cases.items():
        before = snapshot()
        code, err, seconds = _mpmd(train, second)
        lines = _xpnn_lines(err)
        record(case="start-up", moment=case, exit=code, seconds=round(seconds, 2), stderr=said)
        assert code == 2 and seconds < 30, (case, err)
        assert len(lines) == 1 and said in lines[0], (case, err)
        assert "Traceback" not in err
        assert left_behind(before) == [], case
    code, err, _ = _mpmd([*XPNN, "-h"], [*XPNN, "--help"])  # every rank asked: help, exit 0
    assert code == 0 and "Traceback" not in err, err


@pytest.mark.mpi
def test_a_signal_ends_a_rank_waiting_in_mpi_init_for_one_that_never_comes():
    """Rank 1 never starts MPI: SIGTERM to rank 0, inside MPI_Init, ends the job in seconds."""
    proc = subprocess.Popen(
        [mpiexec_path(), "-n", "1", *XPNN, *ARGS, ":", "-n", "1", sys.executable, "-c",
         "import time; time.sleep(60)"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    job = Job.__new__(Job)
    job.proc, job.out = proc, ""
    try:
        rank0 = _xpnn_rank(proc.pid)
        time.sleep(3)  # well inside MPI_Init, waiting for rank 1
        os.kill(rank0, signal.SIGTERM)
        code, err, seconds = job.finish(30)
    finally:
        job.kill()
    lines = _xpnn_lines(err)
    record(case="SIGTERM", moment="MPI_Init, a rank missing", exit=code,
           seconds=round(seconds, 2), stderr=lines[-1] if lines else "")  # fmt: skip
    assert code == 143, err
    assert len(lines) == 1 and "terminated (SIGTERM) while waiting in MPI_Init" in lines[0]


def _xpnn_rank(launcher: int, timeout: float = 60) -> int:
    from faults import _children

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stack = _children(launcher)
        while stack:
            pid = stack.pop()
            stack += _children(pid)
            try:  # the proxy's child between its fork and its exec is not it yet
                line = Path(f"/proc/{pid}/cmdline").read_bytes()
                python = os.readlink(f"/proc/{pid}/exe") == os.path.realpath(sys.executable)
            except OSError:
                continue
            if python and b"-m\x00xpnn" in line:
                return pid
        time.sleep(0.01)
    raise AssertionError("rank 0 did not start")


# ------------------------------------------------------------------------- signals


@pytest.mark.mpi
def test_every_stop_signal_is_one_line_and_128_plus_its_number(tmp_path):
    """SIGHUP and SIGXCPU to every rank (a hang-up reaches the terminal's whole job, Slurm
    signals every task); SIGQUIT to ``mpiexec``, which passes it on; SIGHUP to one rank."""
    cases = [
        (signal.SIGHUP, "all ranks"),
        (signal.SIGXCPU, "all ranks"),
        (signal.SIGQUIT, "mpiexec"),
        (signal.SIGHUP, "rank 1"),
    ]
    for signum, target in cases:
        before = snapshot()
        job = Job([*LONG, "--checkpoint-dir", str(tmp_path / f"{signum}-{target}")])
        try:
            ranks = job.ranks(2)
            job.wait_for_line("epoch 2/")
            pids = {"mpiexec": [job.proc.pid], "rank 1": [ranks[1]]}.get(target, ranks.values())
            for pid in pids:
                os.kill(pid, signum)
            code, err, seconds = job.finish(30)
        finally:
            job.kill()
        name = signal.Signals(signum).name
        lines = _xpnn_lines(err)
        record(case=name, moment=f"mid-training, to {target}", exit=code,
               seconds=round(seconds, 2), stderr=lines[-1] if lines else "")  # fmt: skip
        assert code == 128 + signum, (name, target, err)
        who = "rank 1" if target == "rank 1" else "xpnn"
        assert lines == [f"{who}: terminated ({name})"], (name, target, err)
        assert not left_behind(before)
        assert not list((tmp_path / f"{signum}-{target}").glob("*.tmp"))


@pytest.mark.mpi
def test_sigterm_during_the_final_save_leaves_no_file_and_no_tmp(tmp_path):
    """Every rank waits for rank 0's ``--save`` inside xpnn's signal handling, not in
    MPI_Finalize: the job stops together, one line, exit 143, nothing half-written."""
    saved = tmp_path / "final.npz"
    job = Job([*ARGS, "--epochs", "1", "--save", str(saved)], env={"XPNN_SAVE_FAULT": "sleep:30"})
    try:
        job.ranks(2)
        wait_for_write(job, tmp_path)
        os.kill(job.proc.pid, signal.SIGTERM)
        code, err, seconds = job.finish(30)
    finally:
        job.kill()
    lines = _xpnn_lines(err)
    record(case="SIGTERM", moment="the final --save, to mpiexec", exit=code,
           seconds=round(seconds, 2), stderr=lines[-1] if lines else "")  # fmt: skip
    assert code == 143, err
    assert lines == ["xpnn: terminated (SIGTERM)"], err
    assert sorted(tmp_path.iterdir()) == []


@pytest.mark.mpi
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGQUIT])
def test_sigint_and_sigquit_during_the_final_save_end_as_sigterm_does(tmp_path, signum):
    """The signals hydra's ``mpiexec`` passes on, at the last moment: as SIGTERM above."""
    saved = tmp_path / "final.npz"
    job = Job([*ARGS, "--epochs", "1", "--save", str(saved)], env={"XPNN_SAVE_FAULT": "sleep:30"})
    try:
        job.ranks(2)
        wait_for_write(job, tmp_path)
        os.kill(job.proc.pid, signum)
        code, err, seconds = job.finish(30)
    finally:
        job.kill()
    lines = _xpnn_lines(err)
    name = signal.Signals(signum).name
    record(case=name, moment="the final --save, to mpiexec", exit=code,
           seconds=round(seconds, 2), stderr=lines[-1] if lines else "")  # fmt: skip
    assert code == 128 + signum, err
    words = "interrupted" if signum == signal.SIGINT else f"terminated ({name})"
    assert lines == [f"xpnn: {words}"], err
    assert sorted(tmp_path.iterdir()) == []


@pytest.mark.mpi
def test_signals_hydra_does_not_pass_on_end_mpiexec_and_the_next_run_recovers(tmp_path):
    """SIGHUP, SIGXCPU and SIGUSR2 to hydra's ``mpiexec``, while rank 0 writes a checkpoint:
    ``mpiexec`` has no handler for them and dies of it (exit 128 + n), and its proxy kills
    every rank with SIGKILL within a millisecond, before any rank can say a word. What xpnn
    promises there: every checkpoint with its name is whole, no rank is left, and the write
    cut short leaves nothing (it had no name yet); the ``--resume`` of the job goes on."""
    ck = tmp_path / "ck"
    for signum in (signal.SIGHUP, signal.SIGXCPU, signal.SIGUSR2):
        before = snapshot()
        resume = ["--resume", "auto"] if ck.exists() else []
        job = Job([*LONG, "--checkpoint-dir", str(ck), *resume],
                  env={"XPNN_SAVE_FAULT": "sleep:30"})  # fmt: skip
        try:
            ranks = job.ranks(2)
            wait_for_write(job, ck)
            os.kill(job.proc.pid, signum)
            code, err, seconds = job.finish(30)
        finally:
            job.kill()
        name = signal.Signals(signum).name
        record(case=name, moment="a checkpoint's write, to mpiexec", exit=code,
               seconds=round(seconds, 2), stderr="none: its proxy SIGKILLs the ranks")  # fmt: skip
        assert code == -signum, (name, err)  # a shell shows 128 + n
        assert _xpnn_lines(err) == [], (name, err)
        assert _gone(ranks.values()), name
        assert not list(ck.glob("*.tmp")), name  # the write had no name yet: nothing stays
        for path in ck.glob("checkpoint-epoch*.npz"):
            read_npz(path)  # whole
        assert not left_behind(before)


def _gone(pids, timeout: float = 10) -> bool:
    """Whether the processes end (a zombie not yet reaped counts as ended) within seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                alive += [Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]]
            except OSError:
                continue
        if all(state == "Z" for state in alive):
            return True
        time.sleep(0.01)
    return False


@pytest.mark.mpi
def test_sighup_to_mpiexec_during_the_final_save_leaves_neither_file_nor_tmp(tmp_path):
    """The last moment: the ranks are SIGKILLed inside the write, which had no name yet."""
    job = Job([*ARGS, "--epochs", "1", "--save", str(tmp_path / "final.npz")],
              env={"XPNN_SAVE_FAULT": "sleep:30"})  # fmt: skip
    try:
        ranks = job.ranks(2)
        wait_for_write(job, tmp_path)
        os.kill(job.proc.pid, signal.SIGHUP)
        code, err, seconds = job.finish(30)
    finally:
        job.kill()
    record(case="SIGHUP", moment="the final --save, to mpiexec", exit=code,
           seconds=round(seconds, 2), stderr="none: its proxy SIGKILLs the ranks")  # fmt: skip
    assert code == -signal.SIGHUP, err
    assert _gone(ranks.values())
    assert sorted(tmp_path.iterdir()) == []


@pytest.mark.mpi
def test_a_rank_writes_into_hydras_stdout_pipe_unless_hydra_changes_the_output():
    """Under ``mpiexec`` writing into a pipe, a rank finds that pipe; with ``-l`` (hydra
    prefixes each line with its rank) or into a file, it leaves its output to hydra."""
    probe = "from xpnn.runtime.segments import launcher_stdout as f; print(f())"
    for options, piped in (([], True), (["-l"], False)):
        proc = subprocess.run([mpiexec_path(), *options, "-n", "1", sys.executable, "-c", probe],
                              capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip().endswith("/fd/1") == piped, proc.stdout


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_closed_stdout_is_one_line_and_exit_141(tmp_path, ranks):
    """``python -m xpnn ... | head -1``, alone and under ``mpiexec -n 2``: the rank writing the
    progress lines meets the closed pipe itself (under hydra it writes into ``mpiexec``'s own
    stdout pipe), says so and ends the job; no ``.tmp``, every checkpoint whole."""
    ck = tmp_path / "ck"
    job = Job([*LONG, "--checkpoint-dir", str(ck)], ranks=ranks)
    try:
        first = job.proc.stdout.readline()
        job.proc.stdout.close()  # what `head -1` does once it has its line
        start = time.monotonic()
        err = job.proc.stderr.read()
        code = job.proc.wait(30)
        seconds = time.monotonic() - start
    finally:
        job.kill()
    lines = _xpnn_lines(err)
    record(case="a closed stdout (| head -1)", moment=f"mid-training, {ranks} rank(s)",
           exit=code, seconds=round(seconds, 2), stderr=lines[-1] if lines else "")  # fmt: skip
    assert first.startswith("xpnn: ")
    assert code == 141, err
    who = "rank 0" if ranks == 2 else "xpnn"
    assert lines == [f"{who}: stdout was closed (broken pipe): stopped"], err
    assert not list(ck.glob("*.tmp"))
    for path in ck.glob("checkpoint-epoch*.npz"):
        read_npz(path)


# ------------------------------------------------- checkpoint-and-exit, the metrics file


@pytest.mark.mpi
def test_checkpoint_signal_then_resume_records_every_epoch_once(tmp_path):
    """USR1 after epoch 2: exit 75 once its checkpoint is written. A stop during the next
    checkpoint leaves that epoch's record without its checkpoint, and a full disk half a
    line: the resume drops both, so the file holds epochs 1..5 once, in order."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    common = [*LONG, "--checkpoint-dir", str(ck), "--metrics", str(metrics)]
    job = Job([*common, "--checkpoint-signal", "USR1"])
    try:
        job.ranks(2)
        job.wait_for_line("epoch 2/")
        os.kill(job.proc.pid, signal.SIGUSR1)
        code, err, seconds = job.finish(60)
    finally:
        job.kill()
    said = [line for line in job.out.splitlines() if "SIGUSR1" in line]
    record(case="SIGUSR1 (--checkpoint-signal USR1)", moment="mid-training, to mpiexec",
           exit=code, seconds=round(seconds, 2), stderr=said[-1] if said else "")  # fmt: skip
    assert code == 75, err
    assert len(said) == 1 and "written; stopping with exit 75" in said[0]
    last = int(CHECKPOINT_NAME.fullmatch(checkpoints(ck)[-1].name).group(1))  # epochs done
    assert last >= 2 and _epochs(metrics) == list(range(1, last + 1))

    # a stop while the next checkpoint is written: its epoch's record is in the file
    job = Job([*common, "--resume"], env={"XPNN_SAVE_FAULT": "sleep:30"})
    try:
        job.ranks(2)
        wait_for_write(job, ck)  # epoch last + 1's checkpoint
        os.kill(job.proc.pid, signal.SIGTERM)
        code, err, _ = job.finish(60)
    finally:
        job.kill()
    assert code == 143, err
    assert _epochs(metrics) == list(range(1, last + 2))
    with open(metrics, "a") as fh:
        fh.write('{"event": "epoch", "epo')  # a full disk's half line

    done = run_xpnn([*ARGS, "--epochs", str(last + 3), "--checkpoint-dir", str(ck),
                     "--metrics", str(metrics), "--resume"], ranks=2)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert _epochs(metrics) == list(range(1, last + 4))
    events = [json.loads(line)["event"] for line in metrics.read_text().splitlines()]
    assert events[-1] == "done" and events.count("done") == 1


MID_EPOCH = {  # the run; the line the signal follows; who gets it; the line it stops with
    "epochs": (["--epochs", "3"], "epoch 1/", "rank 1", "of epoch 2's 5 steps) written; stop"),
    "steps": (["--steps", "14", "--eval-every", "4"], "step 8/", "mpiexec", "written; stop"),
}


@pytest.mark.mpi
@pytest.mark.parametrize("mode", MID_EPOCH)
def test_checkpoint_signal_mid_epoch_then_resume_is_bit_exact(tmp_path, mode):
    """USR1 while epoch 2 runs (to rank 1 alone: the ranks agree), or by ``steps`` between two
    evaluations (whose checkpoints a ``checkpoint_dir`` holds): the ranks stop at the end of
    the same step, its checkpoint holds the
    step and the running sums of the epoch's (span's) record; the resume skips the batches
    done, and the parameters and every metrics record equal an uninterrupted run's
    (float64)."""
    extra, line, target, stopped = MID_EPOCH[mode]
    run = [*ARGS, *extra]
    whole = run_xpnn([*run, "--save", str(tmp_path / "whole.npz"),
                      "--metrics", str(tmp_path / "whole.jsonl")], ranks=2)  # fmt: skip
    assert whole.returncode == 0, whole.stderr
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    common = [*run, "--checkpoint-dir", str(ck), "--metrics", str(metrics)]
    # rank 0 pauses before step 7 (epoch 2's third) or 9: the signal lands between records
    pause = "0:7:1" if mode == "epochs" else "0:9:1"
    job = Job([*common, "--checkpoint-signal", "USR1"], env={"XPNN_SLEEP_AT": pause})
    try:
        ranks = job.ranks(2)
        job.wait_for_line(line)
        os.kill(job.proc.pid if target == "mpiexec" else ranks[1], signal.SIGUSR1)
        code, err, seconds = job.finish(60)
    finally:
        job.kill()
    said = [line for line in job.out.splitlines() if "SIGUSR1" in line]
    record(case=f"SIGUSR1 (--checkpoint-signal USR1), by {mode}", moment=f"mid-epoch, to {target}",
           exit=code, seconds=round(seconds, 2), stderr=said[-1] if said else "")  # fmt: skip
    assert code == 75, err
    assert len(said) == 1 and stopped in said[0] and "exit 75" in said[0], job.out
    newest = checkpoints(ck)[-1].name
    epochs, step = CHECKPOINT_NAME.fullmatch(newest).groups()
    stops = range(6, 10) if mode == "epochs" else range(9, 12)  # the steps it may stop after
    assert int(step) in stops and int(epochs) == int(step) // 5, newest  # 5 steps an epoch

    done = run_xpnn([*common, "--resume", "--save", str(tmp_path / "resumed.npz")], ranks=2)
    assert done.returncode == 0, done.stderr
    assert f"resume: {ck / newest} (epoch {int(epochs)}, step {int(step)})" in done.stdout
    a, b = np.load(tmp_path / "whole.npz"), np.load(tmp_path / "resumed.npz")
    assert a.files == b.files and all(np.array_equal(a[k], b[k]) for k in a.files)
    keys = ("event", "epoch", "step", "train_loss", "train_acc", "test_loss", "test_acc")
    assert [_pick(r, keys) for r in _records(metrics)] == [
        _pick(r, keys) for r in _records(tmp_path / "whole.jsonl")
    ]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _pick(record: dict, keys: tuple) -> dict:
    return {key: record.get(key) for key in keys}


def _epochs(metrics: Path) -> list[int]:
    return [
        r["epoch"]
        for r in map(json.loads, metrics.read_text().splitlines())
        if r["event"] == "epoch"
    ]


@pytest.mark.mpi
def test_metrics_refuses_a_file_that_is_not_an_xpnn_metrics_file(tmp_path):
    """The data set's labels, another run's checkpoint: neither is emptied."""
    checkpoint = tmp_path / "c.npz"
    atomic_savez(checkpoint, {"a": np.zeros(3)})
    text = tmp_path / "notes.txt"
    text.write_text("my notes\n")
    for path in (checkpoint, text):
        before = path.read_bytes()
        proc = run_xpnn([*ARGS, "--metrics", str(path)], ranks=2)
        lines = _xpnn_lines(proc.stderr)
        assert proc.returncode == 2, proc.stderr
        assert len(lines) == 1 and "is not an xpnn metrics file" in lines[0]
        assert path.read_bytes() == before
    record(case="--metrics", moment="a file that is not a metrics file", exit=2, seconds=0,
           stderr=lines[0])  # fmt: skip


def test_a_failed_write_leaves_no_half_record(tmp_path, monkeypatch):
    """A full disk mid-line: the file is cut back to its last whole line."""
    path = tmp_path / "m.jsonl"
    metrics_file.append_record(path, {"event": "epoch", "epoch": 1})
    real = os.write

    def full(fd: int, data: bytes) -> int:
        real(fd, bytes(data[:10]))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError):
        metrics_file.append_record(path, {"event": "epoch", "epoch": 2})
    monkeypatch.undo()
    assert path.read_text() == '{"event": "epoch", "epoch": 1}\n'


# --------------------------------------------------------------------- smaller items


def test_a_checkpoint_claiming_terabytes_is_damaged_not_out_of_memory(tmp_path):
    """An ``.npy`` header that claims 10^13 bytes: exit 2 naming the file, not MemoryError."""
    import zipfile

    header = b"{'descr': '<f8', 'fortran_order': False, 'shape': (1250000000000,), }"
    header += b" " * (118 - len(header)) + b"\n"
    with zipfile.ZipFile(tmp_path / "c.npz", "w") as zf:
        zf.writestr("layer0.W.npy", b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little")
                    + header + b"\0" * 64)  # fmt: skip
    with pytest.raises(DamagedCheckpoint, match="c.npz: not a readable checkpoint"):
        read_npz(tmp_path / "c.npz")


def test_save_through_a_symbolic_link_replaces_the_file_it_names(tmp_path):
    target, link = tmp_path / "target.npz", tmp_path / "link.npz"
    link.symlink_to(target)
    atomic_savez(link, {"a": np.ones(2)})
    assert link.is_symlink() and target.is_file()


def test_a_huge_stop_grace_is_refused_in_one_line(tmp_path):
    proc = run_xpnn(ARGS, env={"XPNN_STOP_GRACE": "1e308"})
    assert proc.returncode == 2, proc.stderr
    assert (
        proc.stderr.strip() == "xpnn: XPNN_STOP_GRACE=1e308: expected at most 86400 seconds (a day)"
    )


def test_a_mid_epoch_checkpoint_sorts_between_its_epochs_and_its_sums_are_checked(tmp_path):
    """``checkpoint-epoch0001-step00000009.npz`` comes after epoch 1's and before epoch 2's;
    a ``meta.partial`` that is not the running sums xpnn writes is a damaged checkpoint."""
    from xpnn.train.midepoch import partial_of, saved_partial

    params = {"layer0.W": np.ones(2)}
    good = partial_of("epoch", [[1.5, 3.0], [2.5, 4.0]], 0.25, [8.0, 0.0])
    for epoch, step, partial in ((2, 10, None), (1, 5, None), (1, 9, good)):
        save_checkpoint(tmp_path, params, {}, epoch, step, 0, partial=partial)
    assert [p.name for p in checkpoints(tmp_path)] == [
        "checkpoint-epoch0001.npz",
        "checkpoint-epoch0001-step00000009.npz",
        "checkpoint-epoch0002.npz",
    ]
    assert saved_partial(checkpoints(tmp_path)[1]) == good
    assert saved_partial(checkpoints(tmp_path)[0]) is None
    bad = {**good, "sums": [[1.0, "x"]]}
    path = save_checkpoint(tmp_path, params, {}, 1, 8, 0, partial=bad)
    with pytest.raises(DamagedCheckpoint, match="meta.partial"):
        saved_partial(path)


def test_a_resume_by_steps_keeps_the_records_up_to_its_step(tmp_path):
    path = tmp_path / "m.jsonl"
    for step in (4, 8, 12):
        metrics_file.append_record(path, {"event": "eval", "step": step, "epoch": step / 5})
    assert metrics_file.keep_until(path, 1, step=9) == 1
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [4, 8]


def test_a_steps_run_checkpoints_at_every_evaluation(tmp_path):
    """``--steps 8 --eval-every 4`` writes a checkpoint at steps 4 and 8; a resume there finds
    nothing to train and still says the test accuracy; a longer ``--steps`` goes on."""
    ck = tmp_path / "ck"
    run = [*ARGS, "--steps", "8", "--eval-every", "4", "--checkpoint-dir", str(ck)]
    first = run_xpnn(run)
    assert first.returncode == 0, first.stderr
    assert [p.name for p in checkpoints(ck)] == [
        "checkpoint-epoch0000-step00000004.npz",
        "checkpoint-epoch0001-step00000008.npz",
    ]
    again = run_xpnn([*run, "--resume"])
    assert again.returncode == 0, again.stderr
    assert "--steps 8 reached, nothing to train" in again.stdout
    accuracy = [p.stdout.splitlines()[-1].split(", ")[1] for p in (first, again)]
    assert accuracy[0] == accuracy[1] and accuracy[0].startswith("test_acc 0.")
    more = run_xpnn([*run, "--resume", "--steps", "10"])
    assert more.returncode == 0, more.stderr
    assert "step 10/10" in more.stdout and "step 4/" not in more.stdout
