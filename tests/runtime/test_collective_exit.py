"""Ranks that agreed to leave with one code (exit 75 after a requeue checkpoint) keep it when
the launcher ends them in ``MPI_Finalize`` because another rank left first: srun's
``--kill-on-bad-exit`` sends SIGTERM then, and Python has put SIGTERM's default back by the
time mpi4py finalizes."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import os, signal
from xpnn.runtime.failure import CollectiveExit, run_guarded

def leave():
    raise CollectiveExit(75)

code = run_guarded(None, leave)
os.kill(os.getpid(), signal.SIGTERM)  # the launcher's, as the process ends
raise SystemExit(code)
"""


def test_a_collective_exit_keeps_its_code_through_a_late_sigterm():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert proc.returncode == 75, (proc.returncode, proc.stderr)
