"""Every benchmark refuses a bad argument before it measures anything: exit 2, one line
naming the flag, no traceback (as the xpnn command does)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, run_locked_out, run_with_stdout_closed


@pytest.mark.parametrize(
    ("script", "args", "needle"),
    [
        # 10 B sent 2 float32 values (8 B) and its bandwidth counted 10
        ("optimizer_step", ["--params", "0"], "--params: must be >= 1"),
        ("staging", ["--sizes", "4,-1"], "--sizes"),
        # a free-form choice: refused before the header, not a UserError after it
        # output places are checked before measuring, not written to after it
        ("optimizer_step", ["--json", "/proc/x.json"], "--json /proc/x.json: cannot create files"),
        # comma lists of known names, at least one
        ("optimizer_step", ["--sides", "numpy,bogus"], "--sides: unknown 'bogus'"),
        ("optimizer_step", ["--sides", ""], "--sides: empty"),
        # the mpiexec to run is found now, not when the first run starts
        # within_job: each side's xpnn arguments are checked as xpnn checks them
        ("within_job", ["--a", "--epochs x"], "--a: --epochs: not an integer: 'x'"),
        ("within_job", ["--b", "'unclosed"], "--b: No closing quotation"),
        ("within_job", ["--rounds", "0"], "--rounds: must be >= 1"),
        ("within_job", ["--a", "--seed 1", "--b", "--seed 1"], "nothing to compare"),
        ("within_job", ["--json", "/proc/w.json"], "--json /proc/w.json: cannot create files"),
        ("within_job", ["--a", "--dataset mnist --data-dir /nonexistent"], "no such directory"),
        ("core_contention", ["--cpus", "0,4096"], "--cpus: 4096 is not a CPU this process may"),
        ("core_contention", ["--cpus", "0"], "--cpus: needs two or more CPUs to compare"),
        ("core_contention", ["--cpus", "a"], "--cpus: expected CPU numbers like 0,1"),
        ("core_contention", ["--gemm", "2,3"], "--gemm: expected M,K,N"),
        ("core_contention", ["--stream-mib", "0"], "--stream-mib: must be > 0"),
        ("core_contention", ["--kernels", "fma,x"], "--kernels: unknown 'x'"),
        ("core_contention", ["--json", "/proc/c.json"], "--json /proc/c.json: cannot create files"),
        ("core_contention", ["--gemm", "1,100000,100000"], "--gemm: 37.3 GiB a process"),
        ("core_contention", ["--stream-mib", "1e9"], "--stream-mib: 976562.5 GiB a process"),
        # xpnn's own refusals, made before the first run rather than by it (not mpiexec
        # started, then "run failed (exit 2): <command>" and exit 1)
        # a list value given twice is a slip, not a second measurement
        ("core_contention", ["--kernels", "fma,fma"], "--kernels: 'fma' given twice"),
        ("optimizer_step", ["--sides", "numpy,numpy"], "--sides: 'numpy' given twice"),
        ("staging", ["--sizes", "4,4"], "--sizes: 4 given twice in '4,4'"),
        # an empty path is a slip (--json $UNSET), not the current folder
        ("core_contention", ["--json", ""], "--json: empty path"),
        ("optimizer_step", ["--json", ""], "--json: empty path"),
        ("within_job", ["--json", ""], "--json: empty path"),
        # within_job times training steps only: xpnn flags it would ignore are refused
        ("within_job", ["--a", "--epochs 3"], "--a: --epochs: not used here, --rounds sets"),
        ("within_job", ["--b", "--save /tmp/w.npz"], "--b: --save: not used here"),
        ("within_job", ["--a", "--metrics /tmp/w.jsonl"], "--a: --metrics: not used here"),
        ("within_job", ["--b", "--checkpoint-dir /tmp/w"], "--b: --checkpoint-dir: not used"),
        ("within_job", ["--a", "--resume"], "--a: --resume: not used here"),
        ("within_job", ["--a", "--seed 1", "--", "--epochs", "3"], "--epochs (after --): not"),
        # a side's one word starting with -- is its value, not a flag of within_job's own
        # (not "argument --b: expected one argument")
        ("within_job", ["--a", "--optimizer sgd", "--b", "--resume"], "--b: --resume: not used"),
    ],
)
def test_a_bad_argument_is_a_one_line_usage_error(script, args, needle):
    path = ROOT / "bench" / f"{script}.py"
    proc = subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    # one line: no argparse usage block before it
    (line,) = proc.stderr.strip().splitlines()
    assert line.removeprefix("bench/").startswith(f"{script}.py: error: "), line
    assert needle in line, proc.stderr
    assert proc.stdout == ""  # nothing measured, nothing reported


@pytest.mark.parametrize(("script", "args"), [("optimizer_step", ["--params", "0"])])
def test_a_usage_error_needs_no_installed_xpnn(tmp_path, script, args):
    """``python3 bench/optimizer_step.py`` from a Python without xpnn installed (here, an
    installed one that fails to import stands first on the path) still gives its one-line
    usage error: the scripts use the checkout's xpnn."""
    fake = tmp_path / "not-installed" / "xpnn"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('xpnn is not installed')\n")
    env = {**os.environ, "PYTHONPATH": str(fake.parent)}
    cmd = [sys.executable, str(ROOT / "bench" / f"{script}.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.removeprefix("bench/").startswith(f"{script}.py: error: {args[0]}"), line


@pytest.mark.parametrize(
    ("script", "flag", "name"),
    [
        ("optimizer_step", "--json", "x.json"),
        ("within_job", "--json", "x.json"),
        ("core_contention", "--json", "x.json"),
    ],
)
def test_a_path_this_user_may_not_look_at(tmp_path, script, flag, name):
    """Under a directory the user may not enter even ``stat()`` fails: one line, not a
    PermissionError traceback."""
    locked = tmp_path / "locked"
    locked.mkdir()
    path = locked / name
    proc = run_locked_out([f"bench/{script}.py", flag, str(path)], locked, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{flag}" in proc.stderr and f"{path}: Permission denied" in proc.stderr, proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("core_contention", ["--kernels", "fma", "--rounds", "1", "--seconds", "0"]),
    ],
)
def test_stdout_closed_by_its_reader_stops_in_one_line(tmp_path, script, args):
    """``python bench/X.py | head -1``: as ``python -m xpnn`` there, one line and exit 141
    (not a BrokenPipeError traceback)."""
    code, err = run_with_stdout_closed([f"bench/{script}.py", *args])
    assert code == 141, err
    assert err.splitlines()[-1] == f"{script}.py: stdout was closed (broken pipe): stopped", err
    assert "Traceback" not in err


def test_ctrl_c_in_a_benchmark_is_one_line(tmp_path):
    """SIGINT while the suite waits for the run it times: ``bench: interrupted``, exit 130,
    no KeyboardInterrupt traceback."""
    args = ["--ranks", "1", "--modes", "strong", "--samples", "20000", "--replicate", "1"]
    args += ["--epochs", "200", "--hidden", "64", "--out", str(tmp_path / "r.jsonl")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench", "scaling", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal would
    )
    try:
        time.sleep(4.0)  # the timed run has started
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == "bench: interrupted" and "Traceback" not in err, err


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("script", "args", "needle"),
    [
        ("within_job", ["--bogus"], "within_job.py: error: unrecognized arguments: --bogus"),
        ("within_job", ["--a", "--resume"], "within_job.py: error: --a: --resume: not used"),
    ],
)
def test_under_mpiexec_rank_0_alone_prints_a_usage_error(script, args, needle):
    """Every rank parses the same flags: one line, not one per rank (not usage and error
    twice on 2 ranks)."""
    from conftest import mpiexec_path

    cmd = [mpiexec_path(), "-n", "2", sys.executable, f"bench/{script}.py", *args]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr  # one line
    assert needle in proc.stderr and proc.stdout == ""


HELP_SCRIPTS = [
    "core_contention", "optimizer_step", "staging", "step_phases", "within_job",
]  # fmt: skip


@pytest.mark.parametrize("script", HELP_SCRIPTS)
def test_help_shows_each_default_once_as_the_flag_takes_it(script):
    """No "(default: all allowed) (default: None)", no Python list (``[1, 2]``) where the flag
    takes ``1,2``, and the script's own name (not xpnn's, for step_phases.py)."""
    proc = subprocess.run(
        [sys.executable, f"bench/{script}.py", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    text = " ".join(proc.stdout.split())  # help wraps lines anywhere
    assert proc.stdout.startswith("usage: ") and f"{script}.py" in proc.stdout.splitlines()[0]
    assert "python -m xpnn [train]" not in text
    assert "(default: None)" not in text
    assert not re.search(r"default:? \[", text), text
    assert not re.search(r"\(default[^)]*\) \(default", text), text
