"""The CPUs a cgroup quota (``docker --cpus``) allows: the affinity mask still shows every core."""

import contextlib
import math
from collections.abc import Callable
from pathlib import Path

CGROUP_FS = "/sys/fs/cgroup"


def _v2_limit(folder: Path) -> float | None:
    """cgroup v2's ``cpu.max``: ``max 100000`` (none) or ``50000 100000`` (half a CPU)."""
    quota, _, period = (folder / "cpu.max").read_text().partition(" ")
    return None if quota == "max" else int(quota) / int(period)


def _v1_limit(folder: Path) -> float | None:
    """cgroup v1's ``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us``."""
    quota = int((folder / "cpu.cfs_quota_us").read_text())
    return None if quota < 0 else quota / int((folder / "cpu.cfs_period_us").read_text())


def _limits(mount: Path, path: str, read: Callable[[Path], float | None]) -> list[float]:
    """The quotas on cgroup ``path`` and its ancestors (in a container: the mount point's own)."""
    folder = mount / path.lstrip("/")
    folders = [folder, *folder.parents] if folder.is_dir() else [mount]
    found = []
    for f in (f for f in folders if f.is_relative_to(mount)):
        with contextlib.suppress(OSError, ValueError, ZeroDivisionError):  # no file, or no number
            found.append(read(f))
    return [limit for limit in found if limit is not None]


def cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = CGROUP_FS) -> float | None:
    """The tightest CPU quota on this process's cgroups, in CPUs; None without one."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:  # v2: one tree, the mount point itself
            limits += _limits(Path(root), path, _v2_limit)
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's own tree
            mount = Path(root, "cpu")
            mount = mount if mount.is_dir() else Path(root, controllers)
            limits += _limits(mount, path, _v1_limit)
    return min(limits) if limits else None


def quota_cores(quota: float | None) -> int | None:
    """Whole cores a quota is worth, rounded up (1.5 CPUs keep two threads busy)."""
    return None if quota is None else max(1, math.ceil(quota - 1e-9))
