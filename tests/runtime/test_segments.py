"""Which /dev/shm names xpnn removes at start-up: MPICH's segments that this process maps, and
nothing else. (That a failed two-rank job leaves none behind: ``test_comm.py``.)"""

from __future__ import annotations

import os
from pathlib import Path

from xpnn.runtime.segments import mpich_segments, unlink_mpich_segments


def _maps(*paths: str) -> str:
    """Lines as ``/proc/PID/maps`` writes them, one mapping per path."""
    lines = ["7f00000000-7f00001000 r--p 00000000 00:00 0 ", "7f00002000-7f00003000 rw-p 0 0:0 0"]
    for n, path in enumerate(paths):
        lines.append(f"7f{n:02d}0000000-7f{n:02d}0200000 rw-s 00000000 00:1a 42   {path}")
    return "\n".join(lines) + "\n"


def test_only_named_mpich_segments_in_the_shm_dir() -> None:
    maps = _maps(
        "/dev/shm/mpich_shm_4f613dc5_0",
        "/dev/shm/mpich_shm_4f613dc5_0",  # mapped twice: named once
        "/dev/shm/mpich_shm_aaaa_0 (deleted)",  # removed already
        "/dev/shm/ucx_shm_posix_21121d55 (deleted)",
        "/dev/shm/sm_segment.host.0.1234",  # Open MPI's: left to Open MPI
        "/tmp/mpich_shm_bbbb_0",  # not in the shm folder
        "/dev/shm/sub/mpich_shm_cccc_0",
        "/usr/lib/libmpi.so.12.5.0",
    )
    assert mpich_segments(maps) == ["/dev/shm/mpich_shm_4f613dc5_0"]
    assert mpich_segments("") == []


def test_unlink_removes_mapped_segments_and_skips_missing(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    mapped, other, gone = shm / "mpich_shm_1_0", shm / "mpich_shm_2_0", shm / "mpich_shm_3_0"
    mapped.write_bytes(b"x")
    other.write_bytes(b"y")  # another job's segment: this process does not map it
    maps = tmp_path / "maps"
    maps.write_text(_maps(str(mapped), str(gone)))  # ``gone``: a rank of the node removed it
    assert unlink_mpich_segments(str(maps), str(shm)) == [str(mapped)]
    assert not mapped.exists() and other.exists()
    assert unlink_mpich_segments(str(maps), str(shm)) == []  # a second call finds nothing


def test_no_proc_no_action(tmp_path: Path) -> None:
    assert unlink_mpich_segments(str(tmp_path / "no-such-maps")) == []


def test_only_the_hydra_topology_files_the_parent_holds_open(tmp_path: Path) -> None:
    """The launcher's proxy holds its topology file open: that one is named (once); other
    open files, and other users' topology files that it does not hold, are not."""
    from xpnn.runtime.segments import HYDRA_TOPOLOGY_PREFIX, hydra_topology_files

    fd_dir = tmp_path / "fd"
    fd_dir.mkdir()
    mine = HYDRA_TOPOLOGY_PREFIX + "abc123"
    for fd, target in enumerate([mine, mine, "/tmp/other.txt", "/dev/null", "pipe:[1234]"]):
        (fd_dir / str(fd)).symlink_to(target)
    assert hydra_topology_files(str(fd_dir)) == [mine]
    assert hydra_topology_files(str(tmp_path / "absent")) == []


def test_unlink_hydra_topology_removes_what_the_parent_holds(tmp_path: Path, monkeypatch) -> None:
    from xpnn.runtime import segments

    real = tmp_path / "hydra_hwloc_xmlfile_x"
    real.write_text("<topology/>")
    fd_dir = tmp_path / "fd"
    fd_dir.mkdir()
    (fd_dir / "3").symlink_to(real)
    monkeypatch.setattr(segments, "HYDRA_TOPOLOGY_PREFIX", str(tmp_path / "hydra_hwloc_xmlfile_"))
    assert segments.unlink_hydra_topology(str(fd_dir)) == [str(real)]
    assert segments.unlink_hydra_topology(str(fd_dir)) == []  # gone: another rank's turn
    assert not real.exists()


def test_remove_stale_takes_only_old_unused_files(tmp_path: Path, monkeypatch) -> None:
    """What an earlier job left and nobody uses goes; a file in use or just made stays."""
    from xpnn.runtime import segments

    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    monkeypatch.setattr(segments, "HYDRA_TOPOLOGY_PREFIX", str(tmp / "hydra_hwloc_xmlfile_"))
    old_segment, old_topology = shm / "mpich_shm_aaaa_0", tmp / "hydra_hwloc_xmlfile_old"
    in_use, fresh = shm / "mpich_shm_bbbb_0", tmp / "hydra_hwloc_xmlfile_new"
    other = shm / "sm_segment.host.0"  # Open MPI's: not ours to judge
    for path in (old_segment, old_topology, in_use, fresh, other):
        path.write_bytes(b"x")
    for path in (old_segment, old_topology, in_use, other):
        os.utime(path, (0, 0))  # 1970: long stale
    with open(in_use, "rb"):  # held by a live process: this one
        removed = segments.remove_stale(shm_dir=str(shm))
    assert sorted(removed) == sorted([str(old_segment), str(old_topology)])
    assert in_use.exists() and fresh.exists() and other.exists()
