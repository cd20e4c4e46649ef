"""A rank's share of the machine: R ranks on C cores run C // R threads each, never
oversubscribing them; its peak memory, and whether a network can fit at all."""

import contextlib
import math
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

from xpnn.errors import UserError

REPLACED_ENV: dict[str, str] = {}  # the last apply_threads: those it overrode, and their values
# OpenBLAS's idle workers spin 2^28 cycles (0.1 s) by default, on the cores Numba's team needs
# between products; 2^16 bridges the MLP's products and sleeps through the CNN's passes
# (docs/benchmarks.md, "The hand-off"). Read as the library loads: set before NumPy is imported.
HANDOFF = {"OPENBLAS_THREAD_TIMEOUT": "16"}
HANDOFF_IN_FORCE: dict[str, str] = {}  # what ``set_handoff`` found or set before NumPy loaded


def proc_text(path: str) -> str:
    """A small /proc or /sys file's text; empty where unreadable."""
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as fh:
        return fh.read()
    return ""  # gone, another user's, or not Linux


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


def cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """The tightest cgroup CPU quota (``docker --cpus``, unseen by affinity), in CPUs; else None."""
    limits: list[float] = []
    for line in proc_text(proc_cgroup).splitlines():
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


def affinity() -> frozenset[int]:
    """The cores this process may run on (its affinity mask: cgroups, taskset, binding)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def node_cores() -> int:
    """Cores this process may run on: its affinity mask, or fewer under a CPU quota."""
    cores, limit = len(affinity()), quota_cores(cpu_quota())
    return cores if limit is None else min(cores, limit)


def core_share(
    own: frozenset[int], node: list[frozenset[int]], quota: int | None = None
) -> tuple[int, bool]:
    """(cores for this rank, more ranks than cores) from the node's affinities and quota."""
    sharers = max(1, sum(1 for cores in node if cores & own))
    cores, crowded = max(1, len(own) // sharers), sharers > len(own)
    if quota is not None:
        cores = min(cores, max(1, quota // len(node)))
        crowded = crowded or len(node) > quota
    return cores, crowded


def allocated_cpus(local_size: int, env: Mapping[str, str] | None = None) -> int | None:
    """This rank's CPUs of a Slurm allocation (a shared node's affinity shows the whole machine)."""
    env = os.environ if env is None else env
    per_task = env.get("SLURM_CPUS_PER_TASK", "")
    if per_task.isdigit() and int(per_task) >= 1 and "SLURM_STEP_ID" in env:
        return int(per_task)
    on_node = env.get("SLURM_CPUS_ON_NODE", "")
    if on_node.isdigit() and int(on_node) >= 1 and "SLURM_JOB_ID" in env:
        return max(1, int(on_node) // max(1, local_size))
    return None


def threads_per_rank(
    local_size: int, cores: int | None = None, override: int | None = None, share: int | None = None
) -> int:
    """``override``, else a Slurm share, else ``share``, else ``cores`` over the node's ranks."""
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int) or override < 1:
            raise UserError(f"`threads` {override}: must be a whole number >= 1")
        return override
    if cores is None:
        if (allocated := allocated_cpus(local_size)) is not None:
            own = share if share is not None else max(1, node_cores() // local_size)
            return max(1, min(allocated, own))
        if share is not None:
            return max(1, share)
        cores = node_cores()
    return max(1, cores // local_size)


def apply_threads(n: int) -> dict:
    """BLAS, OpenMP and Numba held to ``n`` threads (``set_threads`` checks it), overrides noted."""
    from xpnn.backends import THREAD_VARS, set_threads  # not before NumPy may load

    REPLACED_ENV.clear()
    REPLACED_ENV.update(
        {var: os.environ[var] for var in THREAD_VARS if os.environ.get(var, str(n)) != str(n)}
    )
    return set_threads(n)


def set_handoff(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Export ``HANDOFF``'s unset variables; in force only if NumPy (its BLAS) is not loaded yet."""
    env = os.environ if env is None else env
    for var, value in HANDOFF.items():
        if not env.get(var):
            env[var] = value
    if "numpy" not in sys.modules:
        HANDOFF_IN_FORCE.update({var: env[var] for var in HANDOFF})
    return dict(HANDOFF_IN_FORCE)


def describe_handoff(handoff: Mapping[str, str]) -> str:
    """``OPENBLAS_THREAD_TIMEOUT=16``; a value from the user's environment is said to be."""
    said = [f"{var}={value}" for var, value in handoff.items()]
    given = [var for var in handoff if HANDOFF.get(var) != handoff[var]]
    return ", ".join(said) + (", from the environment" if given else "")


def one_kernel_thread() -> None:
    """Numba's kernels called from this thread run on it alone, not a team beside another's."""
    if "numba" in sys.modules:
        import numba

        numba.set_num_threads(1)


def describe_threads(record: dict) -> str:
    """``8 thread(s)`` (or each rank's), the batch threads, and the hand-off of several."""
    per_rank = record.get("threads_per_rank") or [record["threads"]]
    handoff = record.get("thread_handoff")
    if record.get("batch_threads"):
        said = f"{record['threads']} thread(s), {record['batch_threads']} of them batch threads"
    elif len(per_rank) == 1:
        said = f"{record['threads']} thread(s)"
    elif len(per_rank) <= 8:
        said = f"{', '.join(map(str, per_rank))} thread(s) (rank by rank)"
    else:
        said = f"{min(per_rank)}-{max(per_rank)} thread(s) (differing by rank)"
    return said + (f" ({describe_handoff(handoff)})" if handoff and max(per_rank) > 1 else "")


def peak_rss_mb() -> float | None:
    """Peak resident memory in MiB (or None): VmHWM, as ``ru_maxrss`` survives fork and exec."""
    for line in proc_text("/proc/self/status").splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)  # kB
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)  # bytes / KiB


def preset_parameters(
    model: object, input_shape: tuple[int, ...], classes: int, hidden: tuple[int, ...],
    gpt_sizes: dict[str, int],
) -> int | None:  # fmt: skip
    """A preset network's parameters before it is built (``gpt``: its blocks' 12 x embed**2)."""
    if model == "mlp":
        widths = [math.prod(input_shape), *hidden, classes]
        return sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))
    if model == "gpt":
        embed, block, layers = (gpt_sizes[k] for k in ("embed", "block", "layers"))
        return embed * (2 * classes + block) + layers * 12 * embed * embed
    return None


def check_network_fits(what: str, params: int | None, itemsize: int, states: int) -> None:
    """Refuse a network beyond memory and swap now: allocated lazily it meets the OOM killer."""
    from xpnn.data.files import memory_bytes

    have = memory_bytes()
    if params is None or have is None:
        return
    need = params * itemsize * (2 + states)
    if need > have:
        raise UserError(
            f"{what}: the network does not fit in memory: its {params:,} parameters need "
            f"{need / 2**30:,.1f} GiB with their gradients and the optimizer's state, more than "
            f"this machine's {have / 2**30:,.1f} GiB of memory and swap"
        )
