"""The CUDA-aware Open MPI prefix that ``bash ci/build-cuda-mpi.sh`` builds, for tests.

Found at ``$XPNN_CUDA_MPI_PREFIX`` or ``.cuda-mpi/`` in the repository. CI does not build it
(half an hour on a busy 2-core machine: docs/cuda-aware-mpi.md), so tests that need it skip,
naming the command that builds it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

BUILD_HINT = "bash ci/build-cuda-mpi.sh"


def cuda_mpi_prefix() -> Path:
    """Where the prefix is looked for (it may not exist)."""
    given = os.environ.get("XPNN_CUDA_MPI_PREFIX", "").strip()
    return Path(given) if given else ROOT / ".cuda-mpi"


def cuda_mpi_env_or_skip() -> dict[str, str]:
    """The environment that the prefix's ``env.sh`` sets up for this Python, or a skip."""
    prefix = cuda_mpi_prefix()
    if not (prefix / "env.sh").is_file():
        pytest.skip(f"no CUDA-aware Open MPI prefix at {prefix}: build it with `{BUILD_HINT}`")
    base = {k: v for k, v in os.environ.items() if k != "XPNN_CUDA_AWARE"}
    base["PYTHON"] = sys.executable
    proc = subprocess.run(
        ["bash", "-c", '. "$1" && env -0', "env.sh", str(prefix / "env.sh")],
        capture_output=True,
        text=True,
        env=base,
        timeout=60,
    )
    assert proc.returncode == 0 and not proc.stderr, proc.stderr  # env.sh found its mpi4py
    env = dict(item.split("=", 1) for item in proc.stdout.split("\0") if "=" in item)
    env["PYTHONUNBUFFERED"] = "1"
    return env
