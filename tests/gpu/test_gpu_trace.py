"""On CuPy a trace holds device spans timed by CUDA events beside the host spans, and a
2-rank ``mpi-host`` trace shows the staging copies on the copies lane.

Skipped, with the reason, where CuPy or a CUDA device is missing (as in CI).
"""

from __future__ import annotations

import json

import pytest
from conftest import TINY_FLOAT64_RUN, cupy_or_skip, run_xpnn

from xpnn.record import phases

pytestmark = pytest.mark.gpu

cupy = cupy_or_skip()


def _spans(path) -> list[dict]:
    return [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]


def test_a_cupy_trace_has_device_spans_inside_its_steps(tmp_path):
    proc = run_xpnn([*TINY_FLOAT64_RUN, "--backend", "cupy", "--trace", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    spans = _spans(tmp_path / "trace-rank0.json")
    device = [e for e in spans if e["tid"] == phases.DEVICE]
    host = [e for e in spans if e["tid"] == phases.COMPUTE and e["name"].startswith("forward ")]
    assert device and {e["name"] for e in host} <= {e["name"] for e in device}
    steps = [e for e in spans if e["cat"] == "step"]
    first, last = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    assert all(first - 1e3 <= e["ts"] <= last + 1e3 for e in device)  # on the host's clock


@pytest.mark.mpi
def test_staged_allreduces_show_their_copies(tmp_path):
    args = [*TINY_FLOAT64_RUN, "--backend", "cupy", "--comm", "mpi-host", "--trace", str(tmp_path)]
    proc = run_xpnn(args, ranks=2)
    assert proc.returncode == 0, proc.stderr
    copies = [e for e in _spans(tmp_path / "trace-rank0.json") if e["tid"] == phases.COPIES]
    assert {"device to host", "host to device (queued)"} <= {e["name"] for e in copies}
