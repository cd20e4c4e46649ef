"""Whether N cores here do N times one core's work: each core alone, then every core at once.

Data parallelism on N ranks of a node is N processes doing the same work side by side, in
lockstep. A step's products may run at full speed on each core, while the rest of it (the
optimizer update, the elementwise passes) streams memory through an L3 cache and a memory bus
that every core shares; on a virtual machine the cores are threads of a host that runs other
guests. Three kernels measure each of those on its own:

- ``fma``: chains of multiply-adds on 4 KiB, in L1: the core's own speed;
- ``stream``: ``y = 0.9 y + x`` over two arrays of ``--stream-mib`` in all (24 MiB: near the
  28 MiB that one Adam step of the MLP 784-1024-1024-10 reads in float32);
- ``gemm``: ``--gemm M,K,N`` on one BLAS thread (the MLP's largest product at batch 128).

Each round runs every kernel on each CPU alone, then on all of them at once (one process
pinned to each, started together once all are warm; the order alternates by round), each
timing calls for ``--seconds``. A record per kernel and process holds its mean call time alone
and together and their ratio, round by round, and the cores other processes used meanwhile.
Ranks in lockstep go at their slowest core's pace, so N / (largest ratio) bounds what N ranks
doing only that kernel reach. With ``--split`` each process together does 1 / N of the work,
as data parallelism splits a fixed batch: then 1 / ratio is N ranks' speedup on that kernel.
A CPU named twice in ``--cpus`` gets two processes: a core shared by two ranks (a ratio near 2).
"""

from __future__ import annotations

import argparse
import os
import select
import subprocess
import sys
import time
from typing import Any

from bench.core import (
    ROOT,
    BenchError,
    RunFailed,
    markdown_table,
    median_of,
    record,
    spread,
)
from bench.flags import (
    choice_list,
    cpu_list,
    int_list,
    nonneg_float,
    positive_float,
    positive_int,
)
from bench.quiet import ForeignLoad

NAME = "core_contention"
SUMMARY = "a kernel alone vs on every core at once (what a shared VM costs a rank)"
REPEATS = "rounds"  # the flag counting its repeats
QUICK = {"kernels": ["fma"], "rounds": 1, "seconds": 0.2}
KERNELS = ("fma", "stream", "gemm")
WORKER = "bench.benchmarks.core_contention"
ONE_THREAD = dict.fromkeys(
    ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"), "1"
)


def gemm_shape(text: str) -> list[int]:
    shape = int_list(text)
    if len(shape) != 3:
        raise argparse.ArgumentTypeError(f"expected M,K,N, got {text!r}")
    return shape


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--kernels", type=choice_list(KERNELS), default=list(KERNELS), help="fma,stream,gemm")
    a("--cpus", type=cpu_list, help="CPUs to use (all allowed); one named twice gets two processes")
    a("--rounds", type=positive_int, default=3, help="alone-then-together rounds")
    a("--seconds", type=nonneg_float, default=1.0, help="timing per kernel and process")
    a("--stream-mib", type=positive_float, default=24.0, help="stream kernel's two arrays, MiB")
    a("--gemm", type=gemm_shape, default=[128, 1024, 1024], help="M,K,N of the product")
    a("--split", action="store_true", help="together, each process does 1 / N of the work")
    a("--timeout", type=positive_float, default=600, help="seconds allowed per set of processes")


def make_kernel(kind: str, stream_mib: float, gemm: list[int], share: int = 1) -> Any:
    """The call to time (a few milliseconds), warmed up and compiled; ``share`` N does 1 / N of
    the work (of the product's rows, the stream's arrays, the chains' repeats)."""
    import numba
    import numpy as np

    if kind == "gemm":
        m, k, n = gemm
        rng = np.random.default_rng(0)
        a, b = rng.random((-(-m // share), k), np.float32), rng.random((k, n), np.float32)
        out = np.empty((a.shape[0], n), np.float32)
        call = lambda: np.matmul(a, b, out=out)  # noqa: E731
    elif kind == "stream":

        @numba.njit(fastmath=True)
        def axpy(y: np.ndarray, x: np.ndarray) -> None:
            for i in range(y.size):
                y[i] = np.float32(0.9) * y[i] + x[i]

        half = max(1, int(stream_mib * 2**20 / 8 / share))  # two float32 arrays
        x, y = np.ones(half, np.float32), np.zeros(half, np.float32)
        call = lambda: axpy(y, x)  # noqa: E731
    else:

        @numba.njit(fastmath=True)
        def chains(a: np.ndarray, reps: int) -> float:
            s = np.zeros(16, np.float32)
            for _ in range(reps):
                for i in range(0, a.size, 16):
                    for j in range(16):
                        s[j] = s[j] * np.float32(0.999) + a[i + j]
            return s.sum()

        data = np.ones(1024, np.float32)
        call = lambda: chains(data, 20000 // share)  # noqa: E731
    call()
    return call


def worker(kind: str, cpu: int, seconds: float, share: int, stream_mib: float, gemm: str) -> None:
    """One pinned process: warm up, say ready, wait for go, print the mean call time. The mean,
    not the median: a core taken away for a while (by the other process, or the host) makes
    lockstep ranks wait, and shows only in the calls' total."""
    os.sched_setaffinity(0, {cpu})
    call = make_kernel(kind, stream_mib, [int(v) for v in gemm.split(",")], share)
    print("ready", flush=True)
    sys.stdin.readline()
    calls, start = 0, time.perf_counter()
    while not calls or time.perf_counter() - start < seconds:
        call()
        calls += 1
    print((time.perf_counter() - start) / calls, flush=True)


def at_once(
    kind: str, cpus: list[int], args: argparse.Namespace, share: int = 1
) -> tuple[list[float], float | None]:
    """Mean call seconds of ``kind`` on each of ``cpus``, all running at once, each doing
    1 / ``share`` of the work; and the cores other processes used while they ran."""
    shape = ",".join(map(str, args.gemm))
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", WORKER, kind, str(c), str(args.seconds), str(share)]
            + [str(args.stream_mib), shape],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,  # python -m finds bench/ here
            env=os.environ | ONE_THREAD,
            start_new_session=True,  # Ctrl-C reaches the suite alone, which ends them
        )
        for c in cpus
    ]
    try:
        for c, p in zip(cpus, procs, strict=True):
            if not select.select([p.stdout], [], [], args.timeout)[0]:
                raise subprocess.TimeoutExpired(p.args, args.timeout)
            if p.stdout.readline().strip() != "ready":
                _, err = p.communicate(timeout=args.timeout)
                tail = "\n".join(err.strip().splitlines()[-8:])
                raise RunFailed(f"the {kind} worker on CPU {c} exited {p.returncode}\n{tail}")
        with ForeignLoad([p.pid for p in procs]) as others:
            for p in procs:
                p.stdin.write("go\n")
                p.stdin.flush()
            times = [float(p.communicate(timeout=args.timeout)[0]) for p in procs]
        return times, others.cores
    except subprocess.TimeoutExpired as e:
        raise RunFailed(f"the {kind} workers took over {args.timeout} s (--timeout)") from e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def check(args: argparse.Namespace) -> list[int]:
    """The CPUs to use, refused here (not as a worker's error) where they cannot be."""
    if not hasattr(os, "sched_setaffinity"):
        raise BenchError("core_contention pins processes to CPUs (os.sched_setaffinity), "
                         "which this OS lacks")  # fmt: skip
    allowed = sorted(os.sched_getaffinity(0))
    cpus = allowed if args.cpus is None else args.cpus
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        raise BenchError(f"--cpus: {outside[0]} is not a CPU this process may use ({allowed})")
    if len(cpus) < 2:
        raise BenchError(f"--cpus: needs two or more CPUs to compare, got {cpus}")
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // len(cpus)
    m, k, n = args.gemm
    needs = {"gemm": 4 * (m * k + k * n + m * n), "stream": args.stream_mib * 2**20}
    for kind in set(args.kernels) & set(needs):
        if needs[kind] > free:
            flag = "--gemm" if kind == "gemm" else "--stream-mib"
            raise BenchError(f"{flag}: {needs[kind] / 2**30:.1f} GiB a process, "
                             f"{free / 2**30:.1f} free")  # fmt: skip
    return cpus


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    cpus = check(args)
    share = len(cpus) if args.split else 1
    times: dict[tuple[str, str], list[list[float]]] = {}  # (kernel, alone|together) -> rounds
    others: dict[str, list[float | None]] = {k: [] for k in args.kernels}
    for r in range(args.rounds):
        for kind in args.kernels:
            sides = ["alone", "together"] if r % 2 == 0 else ["together", "alone"]  # drifts
            for side in sides:
                if side == "alone":
                    runs = [at_once(kind, [c], args) for c in cpus]
                else:
                    runs = [at_once(kind, cpus, args, share)]
                times.setdefault((kind, side), []).append([t for ts, _ in runs for t in ts])
                others[kind] += [o for _, o in runs]
    records = []
    for kind in args.kernels:
        size = {"stream": {"stream_mib": args.stream_mib}, "gemm": {"gemm": args.gemm}}
        for i, cpu in enumerate(cpus):
            config = {"kernel": kind, "process": i, "cpu": cpu, "cpus": cpus}
            config |= {"work_share": share, "seconds": args.seconds, **size.get(kind, {})}
            alone = [1e3 * r[i] for r in times[kind, "alone"]]
            together = [1e3 * r[i] for r in times[kind, "together"]]
            ratio = [t / a for t, a in zip(together, alone, strict=True)]
            samples = {"alone_ms": alone, "together_ms": together, "ratio": ratio}
            info = {"others_cores": others[kind]}  # each set of processes, in order
            records.append(record(NAME, config, samples, machine, info))
    return records


def _others(r: dict[str, Any]) -> float | None:
    seen = [c for c in r["info"].get("others_cores", []) if c is not None]
    return max(seen) if seen else None


def table(records: list[dict[str, Any]]) -> str:
    rows = [[r["config"]["kernel"], r["config"]["cpu"], spread(r, "alone_ms"),
             spread(r, "together_ms"), median_of(r, "ratio"), _others(r)]
            for r in records]  # fmt: skip
    heads = ["kernel", "cpu", "alone ms", "together ms", "together / alone", "others' cores"]
    lines = [markdown_table(heads, rows), ""]
    worst: dict[tuple[str, int, int], float] = {}  # (kernel, processes, share) -> largest ratio
    for r in records:
        key = (r["config"]["kernel"], len(r["config"]["cpus"]), r["config"]["work_share"])
        worst[key] = max(worst.get(key, 0.0), median_of(r, "ratio"))
    for (kind, n, share), ratio in worst.items():
        doing = "splitting" if share > 1 else "each doing"
        lines.append(f"{kind}: slowest process {ratio:.3f}x its time alone; {n} lockstep ranks "
                     f"{doing} only this reach {n / share / ratio:.2f}x one")  # fmt: skip
    lines.append("(mean call time, median over the rounds; others' cores: the most that other "
                 "processes kept busy during a timing)")  # fmt: skip
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    labels = [f"{r['config']['kernel']}\ncpu {r['config']['cpu']}" for r in records]
    ax.bar(range(len(records)), [median_of(r, "ratio") for r in records], tick_label=labels)
    if records:
        ideal = 1 / records[0]["config"]["work_share"]
        ax.axhline(ideal, color="r", ls=":", label="no contention")
        ax.legend(fontsize=7)
    ax.set(ylabel="together / alone", title="core contention")


if __name__ == "__main__":
    a = sys.argv[1:]
    worker(a[0], int(a[1]), float(a[2]), int(a[3]), float(a[4]), a[5])
