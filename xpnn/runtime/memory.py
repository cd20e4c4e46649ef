"""What this process holds: its peak resident memory, for the run's last metrics line."""

from __future__ import annotations

import contextlib
import sys


def peak_rss_mb() -> float | None:
    """Peak resident memory in MiB (or None): VmHWM, as ``ru_maxrss`` survives fork and exec."""
    with contextlib.suppress(OSError), open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)  # kB
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)  # bytes / KiB
