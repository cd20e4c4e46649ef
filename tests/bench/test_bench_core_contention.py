"""``python -m bench core_contention``: kernels timed on each CPU alone and on all at once, one
record per kernel and process, and its refusals before anything is measured."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT, run_bench, run_with_stdout_closed
from test_bench_suite import assert_schema

from bench.core import read_records

CPUS = sorted(os.sched_getaffinity(0))


def bench(*args: str) -> subprocess.CompletedProcess:
    return run_bench("core_contention", *args)


def test_every_kernel_runs_on_every_cpu_given(tmp_path):
    cpus = CPUS[:2] if len(CPUS) > 1 else CPUS * 2
    out = tmp_path / "cc.jsonl"
    proc = bench(
        "--cpus", ",".join(map(str, cpus)), "--rounds", "2", "--seconds", "0",
        "--stream-mib", "1", "--gemm", "8,16,4", "--out", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rs = read_records(out, "core_contention")
    assert [(r["config"]["kernel"], r["config"]["process"]) for r in rs] == [
        (k, i) for k in ("fma", "stream", "gemm") for i in (0, 1)
    ]
    for r in rs:
        assert_schema(r, "core_contention")
        c, m = r["config"], r["metrics"]
        assert c["cpus"] == cpus and c["cpu"] == cpus[c["process"]] and c["work_share"] == 1
        assert c.get("gemm") == ([8, 16, 4] if c["kernel"] == "gemm" else None)
        assert c.get("stream_mib") == (1.0 if c["kernel"] == "stream" else None)
        assert r["repeats"] == 2 and m["alone_ms"]["median"] > 0 and m["together_ms"]["median"] > 0
        pairs = zip(m["together_ms"]["samples"], m["alone_ms"]["samples"], strict=True)
        assert m["ratio"]["samples"] == [t / a for t, a in pairs]  # round by round
        assert len(r["info"]["others_cores"]) == 2 * (len(cpus) + 1)  # each set of processes
    summary = [line.split(":")[0] for line in proc.stdout.splitlines() if "lockstep" in line]
    assert summary == ["fma", "stream", "gemm"]
    again = bench("--from", str(out))  # the table again, from the records alone
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("| fma |") == 2 and "lockstep" in again.stdout


def test_a_cpu_named_twice_gets_two_processes_and_split_shares_the_work(tmp_path):
    cpu = CPUS[0]
    out = tmp_path / "cc.jsonl"
    args = ["--cpus", f"{cpu},{cpu}", "--kernels", "fma", "--rounds", "1", "--seconds", "0"]
    proc = bench(*args, "--split", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rs = read_records(out, "core_contention")
    assert [(r["config"]["process"], r["config"]["cpu"]) for r in rs] == [(0, cpu), (1, cpu)]
    assert {r["config"]["work_share"] for r in rs} == {2}
    worst = max(r["metrics"]["ratio"]["median"] for r in rs)
    assert f"2 lockstep ranks splitting only this reach {1 / worst:.2f}x one" in proc.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--cpus", "0,4096"], "--cpus: 4096 is not a CPU this process may use"),
        (["--cpus", "0"], "--cpus: needs two or more CPUs to compare"),
        (["--cpus", "a"], "--cpus: expected CPU numbers like 0,1"),
        (["--gemm", "2,3"], "--gemm: expected M,K,N"),
        (["--stream-mib", "0"], "--stream-mib: must be > 0"),
        (["--seconds", "nan"], "--seconds: must be a finite number"),
        (["--rounds", "0"], "--rounds: must be >= 1"),
        (["--kernels", "fma,x"], "--kernels: unknown 'x'"),
        (["--kernels", "fma,fma"], "--kernels: 'fma' given twice"),
        # refused here, not as a worker's MemoryError
        (["--gemm", "1,100000,100000"], "--gemm: 37.3 GiB a process"),
        (["--stream-mib", "1e9"], "--stream-mib: 976562.5 GiB a process"),
    ],
)
def test_a_bad_flag_is_one_line_before_anything_runs(tmp_path, args, needle):
    proc = bench("--out", str(tmp_path / "cc.jsonl"), *args)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"bench: {needle}"), line
    assert list(tmp_path.iterdir()) == []


def test_an_os_that_cannot_pin_processes_is_told_so_in_one_line():
    """macOS has no ``os.sched_setaffinity``: refused before measuring, not a traceback."""
    code = "import os, sys; del os.sched_setaffinity; from bench.__main__ import main; "
    code += "sys.exit(main(['core_contention']))"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.strip() == (
        "bench: core_contention pins processes to CPUs (os.sched_setaffinity), which this OS lacks"
    )


def test_stdout_closed_by_its_reader_stops_in_one_line(tmp_path):
    """``python -m bench core_contention | head -1``: as ``python -m xpnn`` there, one line and
    exit 141 (not a BrokenPipeError traceback)."""
    args = ["--kernels", "fma", "--rounds", "1", "--seconds", "0", "--out", str(tmp_path / "c")]
    code, err = run_with_stdout_closed(["-m", "bench", "core_contention", *args])
    assert code == 141, err
    assert err.strip() == "bench: stdout was closed (broken pipe): stopped"
