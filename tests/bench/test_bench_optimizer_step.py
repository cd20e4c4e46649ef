"""bench/optimizer_step.py runs, tiny, and reports a positive time per side."""

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "optimizer_step.py"


def test_optimizer_step_tiny(tmp_path):
    out = tmp_path / "o.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--params",
            "1000",
            "--rounds",
            "1",
            "--calls",
            "5",
            "--sides",
            "numpy,numba",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert set(data["us"]) == {"numpy", "numba"} and all(v > 0 for v in data["us"].values())
    assert "us per update" in proc.stdout
    # the settings with their own types, not strings ("1000", "None"), and none internal
    args = data["args"]
    assert args["params"] == 1000 and args["sides"] == ["numpy", "numba"] and "worker" not in args
    assert args["json"] == str(out)


def _limit_memory() -> None:  # in the child, before it starts Python: like ``ulimit -v 3000000``
    resource.setrlimit(resource.RLIMIT_AS, (3_000_000 * 1024, 3_000_000 * 1024))


def test_a_side_out_of_memory_is_one_line_naming_params(tmp_path):
    """The worker's MemoryError, said in one line with its own words, not the parent's
    CalledProcessError traceback that hides the worker's error."""
    out = tmp_path / "o.json"
    args = ["--params", "300000000", "--sides", "numpy", "--rounds", "1", "--calls", "1"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_limit_memory,
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(
        "optimizer_step.py: error: --params 300000000: too many for memory on the numpy side "
        "(MemoryError: Unable to allocate"
    ), proc.stderr
    assert not out.exists()


def test_a_failing_worker_is_one_line_with_its_last_error(tmp_path):
    """Any other failure of a side: exit 1, the side named, the worker's last error line."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise RuntimeError('this torch is broken')\n")
    env = {**os.environ, "PYTHONPATH": str(fake.parent)}
    args = ["--params", "1000", "--sides", "torch", "--rounds", "1", "--calls", "1"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "optimizer_step.py: error: --sides torch: the worker failed (exit 1): "
        "RuntimeError: this torch is broken"
    ]
