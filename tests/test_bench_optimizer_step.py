"""bench/optimizer_step.py runs, tiny, and reports a positive time per side."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "optimizer_step.py"


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
