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
