"""The benchmark suite works from a plain (not editable) install, outside the clone: the wheel
holds ``bench`` and its GPU recordings, and ``python -m xpnn bench`` runs it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import ROOT


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, a folder it is installed into) built from this checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # a copy: the build's own folders (build/, *.egg-info) stay out of the clone
    skip = shutil.ignore_patterns("__pycache__", "results", "*.egg-info", "build")
    for name in ("xpnn", "bench"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).is_file():
            shutil.copy(ROOT / name, src / name)
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp / "dist"), str(src)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = (tmp / "dist").glob("xpnn-*.whl")
    site = tmp / "site"
    got = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
         str(wheel)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr[-2000:]
    return wheel, site


def _run(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python ARGS`` with the installed copy first on the path and the clone not on it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=300, stdin=subprocess.DEVNULL)  # fmt: skip


def test_the_wheel_holds_the_suite_and_its_recordings(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"bench/__main__.py", "bench/report.py", "bench/benchmarks/crossover.py"} <= names
    assert any(n.startswith("bench/recorded/gpu-") and n.endswith(".jsonl") for n in names)
    assert any(n.startswith("bench/recorded/calibration-") for n in names)  # quick predictions


def test_python_m_xpnn_bench_runs_the_installed_suite(installed, tmp_path):
    _, site = installed
    proc = _run(site, tmp_path, "-c", "import bench, xpnn; print(bench.__file__, xpnn.__file__)")
    assert proc.stdout.startswith(str(site)) and f" {site}" in proc.stdout, proc.stdout
    proc = _run(site, tmp_path, "-m", "xpnn", "bench", "--help")
    assert proc.returncode == 0 and "benchmarks: " in proc.stdout, proc.stderr
    proc = _run(site, tmp_path, "-m", "xpnn", "bench", "crossover", "--sizes", "8,16",
                "--no-extra", "--repeats", "2", "--sample-ms", "1")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "bench" / "results" / "crossover.jsonl").is_file()
    assert not (site / "bench" / "results").exists()  # nothing written into the install
