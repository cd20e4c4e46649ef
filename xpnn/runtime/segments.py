"""Files MPICH leaves when a job never finalizes (MPI_Abort, a killed rank): its node segment
in /dev/shm (memory, until reboot) and hydra's topology file in /tmp. Once every rank of the
node has passed ``MPI_Init`` nobody opens either by name again, so their names can go at once
(a mapped segment stays valid until its last rank exits). Other MPIs clean up after themselves.
"""

from __future__ import annotations

import os
import time

HYDRA_TOPOLOGY_PREFIX = "/tmp/hydra_hwloc_xmlfile_"  # MPICH hydra's name (MPL_mkstemp)
SHM_DIR = "/dev/shm"  # where MPICH and Open MPI keep node-shared segments on Linux
MPICH_PREFIX = "mpich_shm_"
_DELETED = " (deleted)"  # how /proc/PID/maps marks a mapped file whose name is gone


def _unlink(paths: list[str]) -> list[str]:
    """The paths removed; one already gone (another rank of the node) is skipped."""
    removed = []
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    return removed


def mpich_segments(maps: str, shm_dir: str = SHM_DIR) -> list[str]:
    """The MPICH segment files that a ``/proc/PID/maps`` text shows mapped and still named."""
    found: list[str] = []
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or fields[5].endswith(_DELETED):
            continue
        path = fields[5]
        folder, name = os.path.split(path)
        if folder == shm_dir and name.startswith(MPICH_PREFIX) and path not in found:
            found.append(path)
    return found


def unlink_mpich_segments(maps_path: str = "/proc/self/maps", shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink the MPICH segments this process maps; the paths it removed. Call only after a
    collective over the node's ranks, so that all of them have mapped the segment."""
    try:
        with open(maps_path, encoding="utf-8", errors="replace") as f:
            maps = f.read()
    except OSError:
        return []
    return _unlink(mpich_segments(maps, shm_dir))


def hydra_topology_files(fd_dir: str) -> list[str]:
    """The hydra topology files that the process whose ``/proc/PID/fd`` is ``fd_dir`` holds
    open (only the proxy opens them)."""
    try:
        fds = os.listdir(fd_dir)
    except OSError:  # not Linux, or a parent we may not look into: nothing to do
        return []
    found = []
    for fd in fds:
        try:
            target = os.readlink(os.path.join(fd_dir, fd))
        except OSError:  # closed meanwhile
            continue
        if target.startswith(HYDRA_TOPOLOGY_PREFIX) and target not in found:
            found.append(target)
    return found


def unlink_hydra_topology(fd_dir: str | None = None) -> list[str]:
    """Unlink the topology file this rank's hydra proxy (the parent) wrote; the paths removed.
    Call after a collective over the node's ranks, as ``unlink_mpich_segments``."""
    return _unlink(hydra_topology_files(fd_dir or f"/proc/{os.getppid()}/fd"))


STALE_AFTER_S = 60.0  # a live job maps its segment and holds its topology file all along


def files_in_use() -> set[str]:
    """The files that running processes this user may inspect hold open or map."""
    used: set[str] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    used.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    pass
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    fields = line.split(maxsplit=5)
                    if len(fields) == 6:
                        used.add(fields[5].strip())
        except OSError:  # gone, or another user's
            continue
    return used


def remove_stale(min_age: float = STALE_AFTER_S, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove this user's unused MPICH files older than ``min_age`` s (a job killed inside
    ``MPI_Init`` never unlinked them); the paths removed."""
    if not os.path.isdir("/proc"):
        return []
    folder, prefix = os.path.split(HYDRA_TOPOLOGY_PREFIX)
    candidates = []
    for where, start in ((shm_dir, MPICH_PREFIX), (folder, prefix)):
        try:
            names = os.listdir(where)
        except OSError:
            continue
        candidates += [os.path.join(where, n) for n in names if n.startswith(start)]
    now, uid = time.time(), os.getuid()
    old = []
    for path in candidates:
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if info.st_uid == uid and now - info.st_mtime >= min_age:
            old.append(path)
    if not old:
        return []
    used = files_in_use()
    return _unlink([path for path in old if path not in used])
