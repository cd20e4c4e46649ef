"""The signal a run is told to checkpoint on (``--checkpoint-signal USR1``) is a request from
the process's first instant: sent the moment xpnn's first handler is in (``XPNN_HANDLER_MARK``
tells when), long before the trainer exists, it makes the run write the checkpoint of its first
step and exit 75, alone and on one rank of a real ``mpiexec`` job; not the signal's default
action, which would end the rank with no checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, TINY_FLOAT64_RUN, xpnn_cmd

from xpnn.train.checkpoint import checkpoints

ARGS = [*TINY_FLOAT64_RUN, "--hidden", "16", "--epochs", "3"]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_checkpoint_signal_at_the_first_instant_checkpoints_and_exits_75(tmp_path, ranks):
    ck, mark = tmp_path / "ck", tmp_path / "mark"
    args = [*ARGS, "--checkpoint-dir", str(ck), "--checkpoint-signal", "USR1"]
    proc = subprocess.Popen(
        xpnn_cmd(args, ranks), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", "XPNN_HANDLER_MARK": str(mark)},
    )  # fmt: skip
    try:
        rank = ranks - 1  # the last rank alone, under mpiexec
        marked = tmp_path / f"mark.{rank}"
        deadline = time.monotonic() + 60
        while not (marked.exists() and marked.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.001)
        pid = int(marked.read_text())
        os.kill(pid, signal.SIGUSR1)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err
    assert "xpnn: SIGUSR1: checkpoint at step 1 " in out and "Traceback" not in err, (out, err)
    assert [p.name for p in checkpoints(ck)] == ["checkpoint-epoch0000-step00000001.npz"]


@pytest.mark.parametrize("command", [["train", *ARGS], ["info"]])
def test_stdout_on_a_full_disk_is_one_line_naming_stdout(command):
    with open("/dev/full", "w") as full:
        proc = subprocess.run(
            xpnn_cmd(command), stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            timeout=120,
        )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert "cannot write to stdout: No space left on device" in lines[0]


@pytest.mark.mpi
def test_ucx_debug_signal_is_off_before_mpi_starts_unless_the_user_set_it():
    """UCX reads ``UCX_DEBUG_SIGNO`` (SIGHUP by default) when MPI loads it: each rank has it
    0 by then, or the user's own value."""
    code = (
        "import os, sys; from xpnn.runtime.world import init_world; "
        "seen = os.environ.get('UCX_DEBUG_SIGNO'); "
        "sys.modules.get('mpi4py.MPI') is None or sys.exit('MPI loaded first'); "
        "init_world(); os.write(1, os.environ['UCX_DEBUG_SIGNO'].encode() + b'\\n')"
    )  # one write a rank: the two ranks' lines share one pipe, unbuffered under PYTHONUNBUFFERED
    for given, expected in ((None, "0"), ("SIGUSR2", "SIGUSR2")):
        env = {k: v for k, v in os.environ.items() if k != "UCX_DEBUG_SIGNO"}
        env.update({"UCX_DEBUG_SIGNO": given} if given else {})
        proc = subprocess.run(
            [*xpnn_cmd([], 2)[:3], sys.executable, "-c", code], capture_output=True, text=True,
            cwd=ROOT, env=env, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0 and proc.stdout.split() == [expected] * 2, proc.stderr
