"""README.md's *Use it from Python* block runs as written, on the CPU backends."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from conftest import ROOT


def _example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Use it from Python", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README.md: no python block under 'Use it from Python'"
    return match.group(1)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "numba"])
def test_readme_example_trains(backend: str, fashion_dir) -> None:
    code = _example()
    assert 'get_backend("numba")' in code
    code = code.replace('get_backend("numba")', f'get_backend("{backend}")')
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    accuracy = float(re.search(r"accuracy (\d\.\d+)", proc.stdout).group(1))
    assert accuracy >= 0.80, proc.stdout
