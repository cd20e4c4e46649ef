"""Every benchmark refuses a bad argument before it measures anything: exit 2, one line
naming the flag, no traceback (as the xpnn command does); its help reads as its flags do."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, run_bench, run_locked_out

from bench.benchmarks import NAMES


@pytest.mark.parametrize("name", NAMES)
def test_an_unknown_flag_is_a_one_line_usage_error(name):
    proc = bench(name, "--bogus-flag")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()  # no argparse usage block before it
    assert "--bogus-flag" in line, line
    assert proc.stdout == ""  # nothing measured, nothing reported


def test_an_out_path_this_user_may_not_look_at(tmp_path):
    """Under a directory the user may not enter even ``stat()`` fails: one line before
    anything is measured, not a PermissionError traceback after it."""
    locked = tmp_path / "locked"
    locked.mkdir()
    path = locked / "c.jsonl"
    proc = run_locked_out(["-m", "bench", "crossover", "--out", str(path)], locked, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line == f"bench: --out {path}: cannot write there (Permission denied)"


@pytest.mark.parametrize(
    ("out", "needle"),
    [
        ("/proc/c.jsonl", "--out /proc/c.jsonl: cannot write there"),
        ("/tmp", "--out /tmp: is a directory"),
    ],
)
def test_the_records_place_is_checked_before_measuring(out, needle):
    proc = bench("crossover", "--out", out)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert needle in line


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


@pytest.mark.parametrize("name", NAMES)
def test_help_shows_each_default_once_as_the_flag_takes_it(name):
    """No "(default: None)", no Python list (``[1, 2]``) where the flag takes ``1,2``."""
    proc = bench(name, "--help")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    text = " ".join(proc.stdout.split())  # help wraps lines anywhere
    assert proc.stdout.startswith(f"usage: python -m bench {name}"), proc.stdout[:80]
    assert "(default: None)" not in text
    assert not re.search(r"default:? \[", text), text
    assert not re.search(r"\(default[^)]*\) \(default", text), text


def bench(*args: str) -> subprocess.CompletedProcess:
    return run_bench(*args, timeout=60)
