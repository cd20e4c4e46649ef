"""``python -m bench staging``: without a GPU it says why in one line and records nothing; on a
GPU, a record per rank and buffer size with every phase (ci/gpu.sh runs it on 1 and 2 ranks)."""

from __future__ import annotations

import subprocess

import pytest
from conftest import run_bench

from bench.benchmarks.staging import PHASES, gpu_problem
from bench.core import read_records

NO_GPU = gpu_problem()


def bench(*args: str) -> subprocess.CompletedProcess:
    return run_bench("staging", *args)


@pytest.mark.skipif(not NO_GPU, reason="a CUDA device is present: the GPU path runs instead")
@pytest.mark.parametrize("ranks", ["1", "2", "1,2"])
def test_without_a_gpu_it_skips_in_one_line_and_records_nothing(tmp_path, ranks):
    out = tmp_path / "s.jsonl"
    proc = bench("--ranks", ranks, "--out", str(out))
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert proc.stdout.count("\n") == 1 and proc.stdout.startswith("staging: skipped"), proc.stdout
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.skipif(bool(NO_GPU), reason=f"no usable CuPy/CUDA device: {NO_GPU}")
def test_a_record_per_rank_and_size_with_every_phase(tmp_path):
    out = tmp_path / "s.jsonl"
    args = ["--ranks", "1,2", "--sizes", "4,65536", "--iters", "5", "--out", str(out)]
    proc = bench(*args)
    assert proc.returncode == 0, proc.stderr
    rs = read_records(out, "staging")
    assert sorted((r["config"]["ranks"], r["config"]["rank"], r["config"]["size_bytes"])
                  for r in rs) == [(1, 0, 4), (1, 0, 65536), (2, 0, 4), (2, 0, 65536),
                                   (2, 1, 4), (2, 1, 65536)]  # fmt: skip
    for r in rs:
        assert set(r["metrics"]) == {f"{p}_us" for p in PHASES} and r["repeats"] == 5
        assert all(m["median"] > 0 for m in r["metrics"].values())
    assert "set_sync µs" in proc.stdout


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--sizes", "4,-1"], "bench: --sizes: expected positive integers, got '4,-1'"),
        (["--sizes", "4,4"], "bench: --sizes: 4 given twice in '4,4'"),
        (["--iters", "0"], "bench: --iters: must be >= 1, got 0"),
        (["--ranks", "0"], "bench: --ranks: expected positive integers, got '0'"),
    ],
)
def test_a_bad_flag_is_one_line_with_or_without_a_gpu(args, line):
    proc = bench(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == line + "\n"


def test_table_and_plot_are_drawn_from_records_alone(tmp_path):
    """``--from`` needs no GPU: records shaped as the workers send them (rank 0 and 1 of a
    2-rank run) give a row per rank and size and a PNG."""
    from bench.core import describe_machine, record, write_records

    rows = [({"rank": r, "ranks": 2, "size_bytes": b}, {f"{p}_us": [1.0, 2.0, 3.0] for p in PHASES})
            for r in (0, 1) for b in (4, 65536)]  # fmt: skip
    path = write_records(
        tmp_path / "s.jsonl", [record("staging", c, s, describe_machine()) for c, s in rows]
    )
    proc = bench("--from", str(path), "--out", str(path))  # the PNG beside it
    assert proc.returncode == 0, proc.stderr
    cells = [[c.strip() for c in line.split("|")[1:4]] for line in proc.stdout.splitlines()]
    assert [c for c in cells if c[:1] == ["2"]] == [
        ["2", "0", "4"], ["2", "0", "65536"], ["2", "1", "4"], ["2", "1", "65536"],
    ]  # fmt: skip
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
