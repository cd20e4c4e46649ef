"""bench/core_contention.py times kernels on each core alone and on all at once. Two processes
pinned to one CPU must show it: each call takes about twice as long together as alone."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from conftest import ROOT

SCRIPT = ROOT / "bench" / "core_contention.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def table(stdout: str) -> dict[tuple[str, int], list[float]]:
    """(kernel, row index) -> [alone ms, together ms, ratio]."""
    rows: dict[tuple[str, int], list[float]] = {}
    for line in stdout.splitlines()[3:]:
        if not line.strip():
            break
        kind, _cpu, *values = line.split()
        index = sum(1 for k, _ in rows if k == kind)
        rows[kind, index] = [float(v) for v in values]
    return rows


def test_two_processes_on_one_cpu_take_twice_as_long_as_one():
    cpu = str(min(os.sched_getaffinity(0)))
    proc = run("--cpus", f"{cpu},{cpu}", "--kernels", "fma", "--rounds", "1", "--seconds", "0.6")
    assert proc.returncode == 0, proc.stderr
    rows = table(proc.stdout)
    assert set(rows) == {("fma", 0), ("fma", 1)}
    for alone, together, ratio in rows.values():
        assert abs(together / alone - ratio) < 0.01  # one round: the ratio of the two medians
        assert 1.6 < ratio < 2.6  # the CPU is shared: pinning and the common start both work
    assert proc.stdout.splitlines()[-1].startswith("fma: slowest core ")
    reach = float(proc.stdout.splitlines()[-1].split(" reach ")[1].split("x")[0])
    assert 0.75 < reach < 1.25  # two ranks on one core: no faster than one


def test_every_kernel_runs_on_every_cpu_given(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))[:2] * (1 if len(os.sched_getaffinity(0)) > 1 else 2)
    out = tmp_path / "cc.json"
    proc = run(
        "--cpus", ",".join(map(str, cpus)), "--rounds", "2", "--seconds", "0",
        "--stream-mib", "1", "--gemm", "8,16,4", "--json", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = table(proc.stdout)
    assert sorted(rows) == [(k, i) for k in ("fma", "gemm", "stream") for i in (0, 1)]
    summary = proc.stdout.splitlines()[-3:]
    assert [line.split(":")[0] for line in summary] == ["fma", "stream", "gemm"]
    saved = json.loads(out.read_text())  # every round's times, of which the table shows medians
    assert saved["cpus"] == cpus and saved["work_share"] == 1
    for (kind, i), (alone_ms, together_ms, _) in rows.items():
        alone = [r[i] for r in saved["seconds_per_call"]["alone"][kind]]
        together = [r[i] for r in saved["seconds_per_call"]["together"][kind]]
        assert len(alone) == len(together) == 2
        assert abs(1e3 * statistics.median(alone) - alone_ms) < 1e-3 + 1e-3 * alone_ms
        assert abs(1e3 * statistics.median(together) - together_ms) < 1e-3 + 1e-3 * together_ms


def test_split_gives_each_process_its_share_of_the_work():
    """Two processes on one CPU, each with half the work, take as long as one with all of it."""
    cpu = str(min(os.sched_getaffinity(0)))
    args = ["--cpus", f"{cpu},{cpu}", "--kernels", "fma", "--rounds", "1", "--seconds", "0.6"]
    proc = run(*args, "--split")
    assert proc.returncode == 0, proc.stderr
    assert "(1/2 of the work each)" in proc.stdout.splitlines()[0]
    for _alone, _together, ratio in table(proc.stdout).values():
        assert 0.75 < ratio < 1.35  # without the split, about 2 (the test above)
    assert "2 lockstep ranks splitting only this reach " in proc.stdout.splitlines()[-1]


def test_an_os_that_cannot_pin_processes_is_told_so_in_one_line():
    """macOS has no ``os.sched_setaffinity``: refused before measuring, not a traceback."""
    bench = str(ROOT / "bench")
    code = (
        "import os, runpy, sys; del os.sched_setaffinity; "
        f"sys.argv = [{str(SCRIPT)!r}]; sys.path.insert(0, {bench!r}); "
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1].endswith(
        "error: needs to pin processes to CPUs (os.sched_setaffinity), which this OS lacks"
    )
    assert proc.stdout == ""
