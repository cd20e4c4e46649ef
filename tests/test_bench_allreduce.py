"""bench/allreduce.py: the OSU-style table and its JSON. The times are not checked; which
rows there are, their arithmetic and the metadata are."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, mpiexec_path

SCRIPT = str(ROOT / "bench" / "allreduce.py")
SMALL = ["--max-size", "1K", "--iters", "2"]


def test_two_ranks_time_every_size_against_raw_mpi4py(tmp_path):
    out = tmp_path / "a.json"
    proc = subprocess.run(
        [mpiexec_path(), "-n", "2", sys.executable, SCRIPT, *SMALL, "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# allreduce float32 sum, 2 ranks on 1 node(s)")
    data = json.loads(out.read_text())
    assert data["meta"]["ranks"] == 2
    assert data["meta"]["cpus"] == len(os.sched_getaffinity(0))
    rows = data["rows"]
    assert [r["size_bytes"] for r in rows] == [4, 16, 64, 256, 1024]
    for r in rows:
        assert abs(r["overhead"] - r["latency_us"] / r["raw_latency_us"]) < 1e-9
        assert abs(r["algbw_GBps"] - r["size_bytes"] / r["latency_us"] / 1e3) < 1e-9
        assert r["busbw_GBps"] == r["algbw_GBps"]  # 2 (n - 1) / n = 1 on two ranks


def test_an_os_without_affinity_masks_counts_every_cpu(tmp_path):
    """macOS has no ``os.sched_getaffinity``: the JSON's CPU count (written after measuring)
    used to be an AttributeError traceback there."""
    out = tmp_path / "a.json"
    code = (
        "import os, runpy, sys; del os.sched_getaffinity; "
        f"sys.argv = [{SCRIPT!r}, *{SMALL!r}, '--json', {str(out)!r}]; "
        f"sys.path.insert(0, {str(ROOT / 'bench')!r}); "  # as running the file would
        f"runpy.run_path({SCRIPT!r}, run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    meta = json.loads(out.read_text())["meta"]
    assert meta["ranks"] == 1 and meta["cpus"] == os.cpu_count()


def test_a_size_between_units_is_labelled_exactly(monkeypatch) -> None:
    """1536 B was labelled "1 KiB" (rounded down), beside a JSON row of 1536."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import allreduce

    assert [allreduce.human(n) for n in (12, 1024, 1536, 3 << 19)] == [
        "12 B", "1 KiB", "1.5 KiB", "1.5 MiB",
    ]  # fmt: skip
