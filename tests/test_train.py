"""The trainer's own measurements."""

import json
import subprocess
import sys

import numpy as np
from conftest import ROOT

# A process started from this one (fork and exec, as a launcher does): its peak must be its
# own, not this big test process's (which ``getrusage`` would report).
PEAKS = """
import json
import numpy as np
from xpnn.train import peak_rss_mb
before = peak_rss_mb()
block = np.ones(200 * 2**20 // 8)  # 200 MiB, every page written
print(json.dumps([before, peak_rss_mb()]))
"""


def test_peak_rss_is_in_mib_and_sees_a_new_high_water_mark():
    parent = np.ones(500 * 2**20 // 8)  # this process now peaks above 500 MiB
    out = subprocess.run(
        [sys.executable, "-c", PEAKS], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    del parent
    assert out.returncode == 0, out.stderr
    before, after = json.loads(out.stdout)
    assert 10 < before < 300  # a Python with NumPy: tens of MiB; not KiB, not the parent's peak
    assert 190 < after - before < 260
