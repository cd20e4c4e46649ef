"""A cgroup's CPU quota, read from stand-in cgroup trees of both versions (the real check, in
a cgroup with a quota on this machine, is in README's *Threads per rank*)."""

from __future__ import annotations

from pathlib import Path

import pytest

from xpnn.runtime import threads
from xpnn.runtime.threads import cpu_quota, quota_cores


def tree(root: Path, proc_cgroup: str, files: dict[str, str]) -> str:
    """Write ``files`` (paths under ``root``) and the ``/proc/self/cgroup`` text; returns the
    latter's path."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    (root / "proc_cgroup").write_text(proc_cgroup)
    return str(root / "proc_cgroup")


@pytest.mark.parametrize(
    "proc, files, expected",
    [
        # cgroup v2 (Docker --cpus=1.5 with a cgroup namespace: the container's is the root)
        ("0::/\n", {"cpu.max": "150000 100000"}, 1.5),
        ("0::/\n", {"cpu.max": "max 100000"}, None),
        # v2, the process in a child of a limited cgroup: the tightest ancestor counts
        (
            "0::/a/b\n",
            {"a/cpu.max": "200000 100000", "a/b/cpu.max": "max 100000", "cpu.max": "max 100000"},
            2.0,
        ),
        ("0::/a/b\n", {"a/cpu.max": "400000 100000", "a/b/cpu.max": "50000 100000"}, 0.5),
        # cgroup v1, the cpu controller mounted on its own (this machine) or with cpuacct
        ("1:cpu:/job\n", {"cpu/job/cpu.cfs_quota_us": "100000",
                          "cpu/job/cpu.cfs_period_us": "100000"}, 1.0),
        ("4:cpu,cpuacct:/job\n", {"cpu,cpuacct/job/cpu.cfs_quota_us": "250000",
                                  "cpu,cpuacct/job/cpu.cfs_period_us": "100000"}, 2.5),
        ("1:cpu:/job\n", {"cpu/job/cpu.cfs_quota_us": "-1",
                          "cpu/job/cpu.cfs_period_us": "100000"}, None),
        # v1 in a container without a cgroup namespace: the host's path, the container's tree
        ("1:cpu:/docker/abc\n", {"cpu/cpu.cfs_quota_us": "200000",
                                 "cpu/cpu.cfs_period_us": "100000"}, 2.0),
        # a hybrid machine: the v2 line finds no cpu.max, the v1 line has no quota
        ("0::/\n1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"},
         None),
        # files that cannot be read as numbers count as no quota
        ("0::/\n", {"cpu.max": "garbage"}, None),
        ("0::/\n", {"cpu.max": "100000 0"}, None),
        ("", {}, None),
    ],
)  # fmt: skip
def test_the_tightest_quota_of_the_process_cgroups(tmp_path, proc, files, expected):
    assert cpu_quota(tree(tmp_path, proc, files), str(tmp_path)) == expected


def test_no_cgroup_file_no_quota(tmp_path):
    assert cpu_quota(str(tmp_path / "missing"), str(tmp_path)) is None


@pytest.mark.parametrize(
    "quota, cores", [(None, None), (0.2, 1), (1.0, 1), (1.5, 2), (2.0, 2), (2.0000000001, 2)]
)
def test_a_quota_is_worth_whole_cores_rounded_up(quota, cores):
    assert quota_cores(quota) == cores


def test_a_quota_lowers_the_cores_of_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(threads, "affinity", lambda: frozenset(range(8)))
    monkeypatch.setattr(threads, "cpu_quota", lambda: 2.5)
    assert threads.node_cores() == 3
    monkeypatch.setattr(threads, "cpu_quota", lambda: 16.0)  # more time than cores: the cores
    assert threads.node_cores() == 8
    monkeypatch.setattr(threads, "cpu_quota", lambda: None)
    assert threads.node_cores() == 8


@pytest.mark.parametrize(
    "node, quota, expected",
    [
        ([frozenset({0, 1})] * 2, 1, (1, True)),  # 2 ranks, 2 cores seen, 1 CPU of time
        ([frozenset({0, 1})], 1, (1, False)),  # one rank: one thread, not two taking turns
        ([frozenset(range(8))] * 2, 4, (2, False)),  # 4 CPUs of time for 2 ranks
        ([frozenset(range(8))] * 2, 32, (4, False)),  # a quota above the cores changes nothing
    ],
)
def test_ranks_share_a_quota_as_they_share_cores(node, quota, expected):
    assert threads.core_share(node[0], node, quota) == expected
