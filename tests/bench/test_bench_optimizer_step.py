"""``python -m bench optimizer_step``: a record per side with a positive time per round, and
a side that cannot run said in one line."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest
from conftest import ROOT

from bench.core import read_records


def bench(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "bench", "optimizer_step", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env, **kw)


def test_a_record_per_side_with_a_sample_per_round(tmp_path):
    out = tmp_path / "o.jsonl"
    args = ["--params", "1000", "--rounds", "2", "--calls", "5", "--sides", "numpy,numba"]
    proc = bench(*args, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    rs = read_records(out, "optimizer_step")
    assert [r["config"]["side"] for r in rs] == ["numpy", "numba"]
    for r in rs:
        c = r["config"]
        assert set(c) == {"side", "optimizer", "params", "threads", "calls"}
        assert (c["optimizer"], c["params"], c["threads"], c["calls"]) == ("adam", 1000, 2, 5)
        assert r["repeats"] == 2 and r["metrics"]["us_per_update"]["median"] > 0
    assert "µs per update" in proc.stdout and "| numba |" in proc.stdout


def _limit_memory() -> None:  # in the child, before it starts Python: like ``ulimit -v 3000000``
    resource.setrlimit(resource.RLIMIT_AS, (3_000_000 * 1024, 3_000_000 * 1024))


def test_a_side_out_of_memory_is_one_line_naming_params(tmp_path):
    """The worker's MemoryError, said in one line with its own words (exit 2: a smaller
    --params fixes it), not a measured run's failure, and no records."""
    out = tmp_path / "o.jsonl"
    args = ["--params", "200000000", "--sides", "numpy", "--rounds", "1", "--calls", "1"]
    proc = bench(*args, "--out", str(out), preexec_fn=_limit_memory)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    worker = "bench: --params 200000000: too many for memory on the numpy side (MemoryError: "
    ahead = "bench: --params 200000000: needs about 8.9 GiB"  # when less than 18 GiB is free
    assert line.startswith(worker) or line.startswith(ahead), proc.stderr
    assert not out.exists()


def test_a_failing_worker_names_its_side_and_ends_with_its_error(tmp_path):
    """Any other failure of a side: exit 1, its command (which names the side) and the
    worker's last error line."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('this torch is broken')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake.parent), str(ROOT)])}
    proc = bench("--params", "1000", "--sides", "torch", "--rounds", "1", "--calls", "1", env=env)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("bench: a measured run failed: exit 1: "), proc.stderr
    assert "bench.benchmarks.optimizer_step torch 1000 adam" in lines[0], proc.stderr
    assert lines[-1] == "RuntimeError: this torch is broken"


def test_torch_alone_without_pytorch_is_one_line(tmp_path):
    """A machine without PyTorch, made here by a ``sitecustomize`` that marks ``torch`` as
    not importable (``sys.modules`` holding None: ``find_spec`` gives None, imports fail)."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = bench("--sides", "torch", env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        "bench: --sides torch: PyTorch is not installed (pip install torch==2.13.0)"
    )


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--params", "0"], "bench: --params: must be >= 1, got 0"),
        (["--calls", "x"], "bench: --calls: not an integer: 'x'"),
        (["--sides", "numpy,bogus"], "bench: --sides: unknown 'bogus': choose among "),
        (["--sides", ""], "bench: --sides: empty: give a comma list of "),
        (["--sides", "numpy,numpy"], "bench: --sides: 'numpy' given twice in 'numpy,numpy'"),
        (["--optimizer", "lbfgs"], "bench: --optimizer: invalid choice: 'lbfgs'"),
    ],
)
def test_a_bad_flag_is_one_line_before_measuring(args, line):
    proc = bench(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(line), proc.stderr
