"""docs/cluster.md shows the batch scripts the cluster tests run (ci/slurm/*.sbatch) verbatim,
each under its file name: what the page tells users to copy is what was run."""

from __future__ import annotations

import re

from conftest import ROOT

from .conftest import SCRIPTS

PAGE = ROOT / "docs" / "cluster.md"


def test_the_page_quotes_every_batch_script_verbatim():
    text = PAGE.read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    scripts = sorted(SCRIPTS.glob("*.sbatch"))
    assert len(scripts) >= 3
    for script in scripts:
        assert script.read_text(encoding="utf-8") in blocks, f"{script.name} not quoted as is"
        assert f"ci/slurm/{script.name}" in text
