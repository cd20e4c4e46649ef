"""Allreduce latency and bandwidth: xpnn's communicator against raw mpi4py (OSU style).

For float32 buffers from 4 B to ``--max-size`` (x``--step`` apart), it times in-place sum
allreduces through ``xpnn.parallel`` and through ``comm.Allreduce(MPI.IN_PLACE, buf)`` on
the same buffers, alternating the two (and their order) every iteration so that drift in the
machine's state hits both equally. Each timed call starts right after a barrier; a rank's
figure is the median over ``--iters`` calls and the slowest rank's median is reported.

* latency: that median, in microseconds;
* algbw: bytes / latency (what one rank sees);
* busbw: algbw * 2(n-1)/n, the traffic a ring allreduce puts on each link, comparable across
  rank counts (the NCCL-tests convention);
* overhead: xpnn latency / raw latency (target: <= 1.05 from 1 MiB up).

``--backend cupy`` adds device-buffer rows for mpi-cuda, mpi-host (staged through pinned
memory) and nccl, skipping with one line what this machine cannot do.

Run: ``mpiexec -n 2 python bench/allreduce.py [--max-size 64M] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
from _common import Parser, nonneg_int, out_path, positive_int, refuse_unwritable, run_main

os.environ.setdefault("XPNN_FORCE_MPI", "1")  # a plain `python bench/allreduce.py` works too

from xpnn.cli import flag_words  # noqa: E402
from xpnn.errors import UserError  # noqa: E402
from xpnn.parallel.comm import make_communicator  # noqa: E402
from xpnn.runtime import init_world, node_cores  # noqa: E402

HOST_COMMS = ("auto", "mpi-shm", "mpi-host", "self")
"""``--comm`` kinds for the host rows: ``make_communicator``'s CPU kinds (``mpi-cuda`` and
``nccl`` need device buffers: ``--backend cupy`` adds those rows by itself)."""

UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20}
UNITS.update({"MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30})


def parse_size(text: str) -> int:
    """'64M', '1MiB', '4096' -> bytes."""
    s = text.strip().upper()
    digits = s.rstrip("BKMGI")
    unit = s[len(digits) :]
    if not digits.isdigit() or unit not in UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: use e.g. 4096, 64K, 64M")
    return int(digits) * UNITS[unit]


def human(nbytes: int) -> str:
    """``1 KiB``, ``1.5 KiB``: exact where it is not a whole number (1536 B was "1 KiB")."""
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def sizes(max_size: int, step: int) -> list[int]:
    out, s = [], 4
    while s <= max_size:
        out.append(s)
        s *= step
    if out[-1] != max_size and max_size > 4:
        out.append(max_size)
    return out


def time_pair(
    mpi_comm: Any,
    ops: dict[str, Callable[[], None]],
    iters: int,
    warmup: int,
) -> dict[str, float]:
    """Median seconds per call for each op, alternating ops and their order every iteration."""
    names = list(ops)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for i in range(warmup + iters):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            mpi_comm.Barrier()
            t0 = time.perf_counter()
            ops[name]()
            dt = time.perf_counter() - t0
            if i >= warmup:
                samples[name].append(dt)
    local = np.array([statistics.median(samples[name]) for name in names])
    slowest = np.empty_like(local)
    from mpi4py import MPI

    mpi_comm.Allreduce(local, slowest, op=MPI.MAX)
    return dict(zip(names, slowest.tolist(), strict=True))


def row(label: str, nbytes: int, n: int, t: float, t_raw: float | None) -> dict:
    algbw = nbytes / t / 1e9
    return {
        "comm": label,
        "size_bytes": nbytes,
        "latency_us": t * 1e6,
        "raw_latency_us": None if t_raw is None else t_raw * 1e6,
        "overhead": None if t_raw is None else t / t_raw,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (n - 1) / n if n > 1 else 0.0,
        "raw_busbw_GBps": None
        if t_raw is None
        else nbytes / t_raw / 1e9 * 2 * (n - 1) / n
        if n > 1
        else 0.0,
    }


def iters_for(nbytes: int, args: argparse.Namespace) -> int:
    return args.iters if nbytes <= (1 << 20) else args.iters_large


def host_communicator(world: Any, args: argparse.Namespace) -> Any:
    """The communicator of the host rows; collective (a UserError on every rank if unusable)."""
    backend = SimpleNamespace(name="numpy", is_gpu=False, xp=np)
    kind = args.comm if world.size > 1 or args.comm != "auto" else "mpi-host"
    return make_communicator(world, backend, kind)


def host_rows(world: Any, args: argparse.Namespace, comm: Any) -> list[dict]:
    from mpi4py import MPI

    raw_comm = MPI.COMM_WORLD
    rows = []
    for nbytes in sizes(args.max_size, args.step):
        buf = np.zeros(nbytes // 4, dtype=np.float32)  # zeros: sums never overflow
        t = time_pair(
            raw_comm,
            {
                "xpnn": lambda buf=buf: comm.allreduce_(buf),
                "raw": lambda buf=buf: raw_comm.Allreduce(MPI.IN_PLACE, buf),
            },
            iters_for(nbytes, args),
            args.warmup,
        )
        rows.append(row(comm.name, nbytes, world.size, t["xpnn"], t["raw"]))
        if world.rank == 0:
            print_row(rows[-1])
    return rows


def device_rows(world: Any, args: argparse.Namespace) -> list[dict]:
    try:
        import cupy

        cupy.cuda.Device(world.local_rank % cupy.cuda.runtime.getDeviceCount()).use()
    except Exception as exc:
        if world.rank == 0:
            print(f"skip device rows: CuPy/CUDA not usable ({exc})")
        return []
    from mpi4py import MPI

    backend = SimpleNamespace(name="cupy", is_gpu=True, xp=cupy)
    raw_comm = MPI.COMM_WORLD
    rows = []
    for kind in ("mpi-cuda", "mpi-host", "nccl"):
        comm = make_communicator(world, backend, kind)
        if comm.fallback_reason:
            if world.rank == 0:
                print(f"skip {kind}: {comm.fallback_reason}")
            continue
        sync = cupy.cuda.get_current_stream().synchronize
        for nbytes in sizes(args.max_size, args.step):
            buf = cupy.zeros(nbytes // 4, dtype=cupy.float32)

            def ours(comm: Any = comm, buf: Any = buf, sync: Any = sync) -> None:
                comm.allreduce_(buf)
                sync()

            ops = {"xpnn": ours}
            if kind == "mpi-cuda":

                def raw(buf: Any = buf, sync: Any = sync) -> None:
                    sync()
                    raw_comm.Allreduce(MPI.IN_PLACE, buf)

                ops["raw"] = raw
            t = time_pair(raw_comm, ops, iters_for(nbytes, args), args.warmup)
            rows.append(row(f"{kind} (device)", nbytes, world.size, t["xpnn"], t.get("raw")))
            if world.rank == 0:
                print_row(rows[-1])
    return rows


HEADER = (
    f"{'comm':<18}{'size':>10}{'xpnn us':>12}{'raw us':>12}{'overhead':>10}"
    f"{'algbw GB/s':>12}{'busbw GB/s':>12}{'raw busbw':>11}"
)


def print_row(r: dict) -> None:
    def f(x: float | None, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    print(
        f"{r['comm']:<18}{human(r['size_bytes']):>10}{r['latency_us']:>12.2f}"
        f"{f(r['raw_latency_us'], '.2f'):>12}{f(r['overhead'], '.3f'):>10}"
        f"{r['algbw_GBps']:>12.3f}{r['busbw_GBps']:>12.3f}{f(r['raw_busbw_GBps'], '.3f'):>11}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = Parser(description=__doc__.split("\n")[0])
    p.add_argument("--max-size", type=parse_size, default=64 << 20, help="largest buffer (64M)")
    p.add_argument("--step", type=int, default=4, choices=(2, 4, 8), help="size multiplier")
    p.add_argument(
        "--iters", type=positive_int, default=200, help="timed calls per size up to 1 MiB"
    )
    p.add_argument("--iters-large", type=positive_int, default=40, help="timed calls above 1 MiB")
    p.add_argument("--warmup", type=nonneg_int, default=10, help="untimed calls per size")
    p.add_argument("--backend", choices=("numpy", "cupy"), default="numpy")
    p.add_argument(
        "--comm", choices=HOST_COMMS, default="auto", help="communicator for the host rows (auto)"
    )
    p.add_argument(
        "--json", type=out_path, metavar="FILE", help="write the rows and machine facts here"
    )
    args = p.parse_args(argv)
    if args.max_size < 4 or args.max_size % 4:  # float32 values: 10 B would send 8
        p.error(f"--max-size: must be a multiple of 4 bytes (float32 values), got {args.max_size}")
    if args.json is not None:
        refuse_unwritable(p, "--json", args.json)

    world = init_world()
    from mpi4py import MPI

    try:  # before the header: a --comm this job cannot use is one line, nothing measured
        host_comm = host_communicator(world, args)
    except UserError as exc:
        if world.rank == 0:
            print(f"{p.prog}: error: {flag_words(str(exc))}", file=sys.stderr)
        return 2
    if world.rank == 0:
        lib = " ".join(MPI.Get_library_version().split()[:3])
        print(
            f"# allreduce float32 sum, {world.size} ranks on {world.size // world.local_size} "
            f"node(s), {lib}, mpi4py {__import__('mpi4py').__version__}; median of "
            f"{args.iters} (<=1 MiB) / {args.iters_large} (>1 MiB) calls, slowest rank"
        )
        if world.size == 1:
            print("# 1 rank: this measures MPI's self path; run under mpiexec -n 2 or more")
        print(HEADER)
    rows = host_rows(world, args, host_comm)
    if args.backend == "cupy":
        rows += device_rows(world, args)

    if world.rank == 0 and args.json:
        meta = {
            "ranks": world.size,
            "local_size": world.local_size,
            "host": socket.gethostname(),
            "platform": platform.platform(),
            "cpus": node_cores(),  # the affinity mask where the OS has one (not macOS)
            "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
            "iters": args.iters,
            "iters_large": args.iters_large,
            "warmup": args.warmup,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        with open(args.json, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
        print(f"# wrote {args.json}")
    return 0


if __name__ == "__main__":
    run_main(main)
