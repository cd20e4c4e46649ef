"""MPICH's node segment is unlinked as soon as every rank of the node has mapped it.

MPICH keeps its intra-node message buffers in a file under /dev/shm (``mpich_shm_*``, 2 MiB
for two ranks) and removes the file in ``MPI_Finalize``. A job that never finalizes leaves it
behind: one that ends through ``MPI_Abort`` (how xpnn stops every rank when one fails) or whose
rank was killed. /dev/shm is memory, so each failed job would keep 2 MiB of RAM until the
machine reboots, and a test suite that fails jobs on purpose would pile up gigabytes.

Once every rank of the node has passed ``MPI_Init`` the segment is mapped everywhere and
nobody opens it by name again, so its name can go at once (UCX does the same with its own
segments): the memory stays valid while any rank maps it and is freed when the last one exits,
however it exits. Only MPICH's names are touched; other MPI libraries clean up after
themselves or may open their files later.

MPICH's launcher leaves a second file: hydra's proxy writes the node's hardware topology to
``/tmp/hydra_hwloc_xmlfile_*`` for its ranks to read in ``MPI_Init`` (instead of each probing
the hardware) and removes it when the job ends normally; a job ended by ``MPI_Abort`` or a
signal kills the proxy first, and the 5 KB file stays for good. The proxy keeps the file open
(``/proc/PPID/fd``), which is how a rank finds the one of its own job; once every rank of the
node has passed ``MPI_Init`` nobody reads it again, so it goes at the same moment.
"""

from __future__ import annotations

import os
import time

HYDRA_TOPOLOGY_PREFIX = "/tmp/hydra_hwloc_xmlfile_"  # MPICH hydra's name (MPL_mkstemp)
SHM_DIR = "/dev/shm"  # where MPICH and Open MPI keep node-shared segments on Linux
MPICH_PREFIX = "mpich_shm_"
_DELETED = " (deleted)"  # how /proc/PID/maps marks a mapped file whose name is gone


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
    """Unlink the MPICH segments this process maps; the paths it removed.

    Call only after a collective over the node's ranks, so that all of them have mapped the
    segment. Every rank may call it: a name another rank removed first is skipped. Where there
    is no ``/proc`` (not Linux) nothing is done.
    """
    try:
        with open(maps_path, encoding="utf-8", errors="replace") as f:
            maps = f.read()
    except OSError:
        return []
    removed = []
    for path in mpich_segments(maps, shm_dir):
        try:
            os.unlink(path)
        except OSError:  # gone already (another rank of the node), or not ours to remove
            continue
        removed.append(path)
    return removed


def hydra_topology_files(fd_dir: str) -> list[str]:
    """The hydra topology files that the process whose ``/proc/PID/fd`` is ``fd_dir`` holds
    open (its launcher's proxy: only it opens them)."""
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
    """Unlink the topology file that this rank's hydra proxy (the parent process) wrote for
    ``MPI_Init``; the paths removed. Call after a collective over the node's ranks, as
    ``unlink_mpich_segments``. Under other launchers the parent holds no such file."""
    removed = []
    for path in hydra_topology_files(fd_dir or f"/proc/{os.getppid()}/fd"):
        try:
            os.unlink(path)
        except OSError:  # another rank of the node removed it first
            continue
        removed.append(path)
    return removed


STALE_AFTER_S = 60.0  # a live job maps its segment and holds its topology file all along


def _ours_in_use() -> set[str]:
    """The files that this user's running processes hold open or map (other users' are not
    ours to read, and their files not ours to remove)."""
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
    """Remove what earlier jobs of this user left that no process uses: MPICH segments and
    hydra topology files older than ``min_age`` seconds; the paths removed.

    A job can end before xpnn's own removal runs: a rank killed by a signal during Python's
    start-up while another waits inside ``MPI_Init`` (Ctrl-C to ``mpiexec`` in its first
    tenth of a second), which neither MPICH nor hydra cleans up after. The next job removes
    them. Only this user's files, unused by any of this user's processes, old enough that no
    job is still setting them up."""
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
    used = _ours_in_use()
    removed = []
    for path in old:
        if path in used:
            continue
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    return removed
