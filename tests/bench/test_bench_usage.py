"""Every benchmark refuses a bad argument before it measures anything: exit 2, one line
naming the flag, no traceback (as the xpnn command does)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, run_locked_out


@pytest.mark.parametrize(
    ("script", "args", "needle"),
    [
        ("throughput", ["--steps", "0"], "--steps: must be >= 1"),
        # a free-form choice: refused before the header, not a UserError after it
        # output places are checked before measuring, not written to after it
        ("throughput", ["--json", "/proc/t.json"], "--json /proc/t.json: cannot create files"),
        # comma lists of known names, at least one
        ("throughput", ["--backends", ","], "--backends: empty"),
        # counts and durations: non-negative, finite
        ("throughput", ["--retries", "-1"], "--retries: must be >= 0"),
        ("throughput", ["--gap", "-1"], "--gap: must be >= 0"),
        ("throughput", ["--gap", "nan"], "--gap: must be a finite number"),
        # the mpiexec to run is found now, not when the first run starts
        # xpnn's own rule for --seed (an integer >= 0), applied before any run
        ("throughput", ["--seed", "-1"], "--seed: must be >= 0"),
        # xpnn's own refusals, made before the first run rather than by it (not mpiexec
        # started, then "run failed (exit 2): <command>" and exit 1)
        # the first epoch is not timed: one epoch would time nothing
        (
            "throughput",
            ["--ranks-compare", "--ranks-epochs", "1"],
            "--ranks-epochs: must be >= 2, got 1: the first epoch includes compilation",
        ),
        # a list value given twice is a slip, not a second measurement
        ("throughput", ["--backends", "numpy,numba,numpy"], "--backends: 'numpy' given twice"),
        ("throughput", ["--batches", "32,32"], "--batches: 32 given twice in '32,32'"),
        # an empty path is a slip (--json $UNSET), not the current folder
        ("throughput", ["--json", ""], "--json: empty path"),
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


@pytest.mark.parametrize(
    ("script", "flag", "name"),
    [
        ("throughput", "--json", "x.json"),
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


HELP_SCRIPTS = ["throughput"]


@pytest.mark.parametrize("script", HELP_SCRIPTS)
def test_help_shows_each_default_once_as_the_flag_takes_it(script):
    """No "(default: all allowed) (default: None)", no Python list (``[1, 2]``) where the flag
    takes ``1,2``, and the script's own name."""
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
