"""How BLAS's idle threads hand the cores to Numba's: exported before NumPy loads in every
process the command line and the benchmarks start, a user's own value kept and said."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT

from bench.core import read_records
from xpnn.runtime.threads import HANDOFF

VAR = "OPENBLAS_THREAD_TIMEOUT"
TRAIN = [
    "train", "--dataset", "synthetic", "--synthetic-size", "200", "--hidden", "8",
    "--epochs", "1", "--batch-size", "50", "--no-progress", "--backend", "numpy",
]  # fmt: skip


def _env(**given: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != VAR and not k.startswith(("PMI_", "SLURM_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env | given


def _train(tmp_path, threads: int, **given: str) -> tuple[str, dict]:
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "xpnn", *TRAIN, "--threads", str(threads)]
    proc = subprocess.run(
        [*cmd, "--metrics", str(metrics)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(**given),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(metrics.read_text().splitlines()[0])


def test_the_command_line_exports_the_handoff_and_records_it(tmp_path):
    out, record = _train(tmp_path, 2)
    assert HANDOFF[VAR] == "16"
    assert record["thread_handoff"] == {VAR: "16"}
    assert f"1 rank(s) x 2 thread(s) ({VAR}=16)" in out
    out, record = _train(tmp_path, 1)  # no thread to hand anything to: not said
    assert record["thread_handoff"] == {VAR: "16"} and f"{VAR}" not in out


def test_a_users_own_value_wins_and_is_said(tmp_path):
    out, record = _train(tmp_path, 2, **{VAR: "9"})
    assert record["thread_handoff"] == {VAR: "9"}
    assert f"2 thread(s) ({VAR}=9, from the environment)" in out


def test_set_before_numpy_loads_and_claimed_only_then():
    code = textwrap.dedent(
        f"""
        import os, sys
        from xpnn.runtime.threads import set_handoff
        assert set_handoff() == {{"{VAR}": "16"}} and "numpy" not in sys.modules
        import numpy
        print("SEEN", os.environ["{VAR}"])
        from xpnn.runtime import threads
        threads.HANDOFF_IN_FORCE.clear()
        assert set_handoff() == {{}}  # NumPy's BLAS read the environment already
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env()
    )
    assert proc.returncode == 0, proc.stderr
    assert "SEEN 16" in proc.stdout


@pytest.mark.parametrize("given", [None, "7"])
def test_the_benchmarks_workers_start_with_it(tmp_path, given):
    out = tmp_path / "l.jsonl"
    cmd = [sys.executable, "-m", "bench", "limit", "--quick", "--models", "mlp"]
    cmd += ["--backends", "numpy", "--threads", "1", "--repeats", "1", "--out", str(out)]
    env = _env(**({VAR: given} if given else {}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    (record,) = read_records(out, "limit")
    assert record["info"]["thread_handoff"] == {VAR: given or "16"}
