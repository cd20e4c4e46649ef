"""A stalled job with no output directory of its own (no --metrics, --checkpoint-dir or --trace)
writes its flight records to a temporary directory and names it in the stall line."""

from __future__ import annotations

import glob
import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import TINY_FLOAT64_RUN, run_xpnn

from xpnn.runtime import flight


@pytest.mark.mpi
def test_a_stall_without_an_output_directory_names_temporary_flight_records():
    args = [*TINY_FLOAT64_RUN, "--hidden", "16", "--stall-warn", "1", "--stall-abort", "2"]
    proc = run_xpnn(args, ranks=2, timeout=120, env={"XPNN_SLEEP_AT": "1:3:10"})
    assert proc.returncode == 124, proc.stderr
    found = re.search(r"flight records in (\S+flight-rank\*\.json);", proc.stderr)
    assert found, proc.stderr
    files = glob.glob(found[1])
    try:
        assert files, found[1]
        for path in files:
            assert Path(path).parent.stat().st_mode & 0o777 == 0o700  # mkdtemp's: this user's
            doc = json.loads(Path(path).read_text())
            assert doc["rank"] == 0 and doc["operations"], path
    finally:
        for path in files:
            shutil.rmtree(Path(path).parent, ignore_errors=True)


def test_other_dumps_without_a_directory_write_nothing(monkeypatch):
    """A failing rank's dump stays off where the run named no directory: no litter in /tmp."""
    monkeypatch.setitem(flight._state, "dir", None)
    monkeypatch.setitem(flight._state, "temp", None)
    assert flight.dump("failed: a test") is None and flight.dump_pattern() is None
