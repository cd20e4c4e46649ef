"""Whether N cores here do N times one core's work: each core alone, then every core at once.

Data parallelism on N ranks of a node is N processes doing the same work side by side, in
lockstep. The issue behind ``bench/scaling.py``'s target assumes that two single-threaded
products run at full speed each on this machine; the rest of a step (the optimizer update,
the elementwise passes) streams memory through an L3 cache and a memory bus that every core
shares, and on a virtual machine the cores are threads of a host that runs other guests.
This measures each of those on its own, with three kernels:

- ``fma``: chains of multiply-adds on 4 KiB, in L1: the core's own speed (its clock, a host
  thread sharing its physical core);
- ``stream``: ``y = 0.9 y + x`` over two arrays of ``--stream-mib`` in all (default 24 MiB,
  near the 28 MiB that one Adam step of the MLP 784-1024-1024-10 reads in float32): the
  traffic of an optimizer step, which every core draws from one L3 cache and memory bus;
- ``gemm``: ``--gemm M,K,N``, one BLAS thread (default 128 x 1024 @ 1024 x 1024 float32, the
  MLP's largest product at batch 128).

Each round runs every kernel on each core alone, then on all the cores at once (one process
pinned to each, started together once all are warm), and times calls for ``--seconds``; the
table shows each core's mean call time (median over the rounds) and the median of its
per-round together / alone ratios. Ranks in lockstep go at their slowest core's pace, so the
largest ratio of a kernel bounds what N ranks doing only that kernel can reach: N / ratio
times one.

With ``--split``, each of the N processes together does 1 / N of the work (of the product's
rows, of the stream's arrays), as data parallelism splits a fixed batch: then 1 / ratio is
the speedup of N ranks over one on that kernel, and a split stream shows whether the smaller
shares fit a cache that the whole did not.

Run: ``python bench/core_contention.py [--split] [--rounds 3] [--cpus 0,1] [--json F]``.
A CPU named twice gets two processes: that measures a core shared by two ranks (a ratio near
2).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from _common import (
    DefaultsFormatter,
    Parser,
    choice_list,
    cpu_list,
    format_table,
    int_list,
    machine_info,
    median,
    nonneg_float,
    out_path,
    positive_int,
    refuse_unwritable,
    run_main,
    write_json,
)

PROG = "bench/core_contention.py"
KERNELS = ("fma", "stream", "gemm")
ONE_THREAD = {
    name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
} | {"NUMBA_NUM_THREADS": "1"}


def make_kernel(kind: str, stream_mib: float, gemm: list[int], share: int = 1):
    """The call to time (a few milliseconds each), warmed up and compiled; ``share`` N does
    1 / N of the work (of the product's rows, the stream's arrays, the chains' repeats)."""
    import numba
    import numpy as np

    if kind == "gemm":
        m, k, n = gemm
        m = -(-m // share)
        rng = np.random.default_rng(0)
        a, b = rng.random((m, k), np.float32), rng.random((k, n), np.float32)
        out = np.empty((m, n), np.float32)
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


def worker(args: argparse.Namespace) -> int:
    """One pinned process: warm up, say ready, wait for go, print the mean call time. The mean,
    not the median: a core taken away for a while (by the other process, or the host) makes
    lockstep ranks wait, and shows only in the calls' total."""
    os.sched_setaffinity(0, {args.cpu})
    call = make_kernel(args.worker, args.stream_mib, args.gemm, args.share)
    print("ready", flush=True)
    sys.stdin.readline()
    calls, start = 0, time.perf_counter()
    while not calls or time.perf_counter() - start < args.seconds:
        call()
        calls += 1
    print((time.perf_counter() - start) / calls, flush=True)
    return 0


def run_at_once(
    kind: str, cpus: list[int], args: argparse.Namespace, share: int = 1
) -> list[float]:
    """Mean call seconds of ``kind`` on each of ``cpus``, all running at once, each doing
    1 / ``share`` of the work."""
    cmd = [sys.executable, __file__, "--worker", kind, "--seconds", str(args.seconds)]
    cmd += ["--share", str(share)]
    cmd += ["--stream-mib", str(args.stream_mib), "--gemm", ",".join(map(str, args.gemm))]
    env = os.environ | ONE_THREAD
    procs = [
        subprocess.Popen(
            [*cmd, "--cpu", str(c)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,  # Ctrl-C reaches this script alone, which ends them
        )
        for c in cpus
    ]
    try:
        for c, p in zip(cpus, procs, strict=True):
            if p.stdout.readline().strip() != "ready":  # its own error went to stderr
                raise SystemExit(f"{PROG}: the {kind} worker on CPU {c} failed (exit {p.wait()})")
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        return [float(p.communicate()[0]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(
        prog=PROG,
        description=__doc__.splitlines()[0],
        formatter_class=DefaultsFormatter,
    )
    a = ap.add_argument
    a("--kernels", type=choice_list(KERNELS), default=list(KERNELS), help="comma list")
    a(
        "--cpus",
        type=cpu_list,
        default=None,
        help="CPUs to use (default: all allowed); one named twice gets two processes",
    )
    a("--rounds", type=positive_int, default=3, help="alone-then-together rounds")
    a("--seconds", type=nonneg_float, default=1.0, help="timing per kernel and process")
    a("--stream-mib", type=positive_float, default=24.0, help="stream kernel's two arrays, MiB")
    a("--gemm", type=gemm_shape, default=[128, 1024, 1024], help="M,K,N of the product")
    a("--split", action="store_true", help="together, each core does 1 / N of the work")
    a("--json", type=out_path, default=None, help="also write every round's times here")
    a("--worker", choices=KERNELS, help=argparse.SUPPRESS)
    a("--share", type=positive_int, default=1, help=argparse.SUPPRESS)
    a("--cpu", type=int, help=argparse.SUPPRESS)
    return ap


def positive_float(text: str) -> float:
    value = nonneg_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def gemm_shape(text: str) -> list[int]:
    shape = int_list(text)
    if len(shape) != 3:
        raise argparse.ArgumentTypeError(f"expected M,K,N, got {text!r}")
    return shape


Timings = dict[str, list[list[float]]]  # kernel -> a list per round -> a time per CPU


def measure(args: argparse.Namespace, cpus: list[int], share: int) -> tuple[Timings, Timings]:
    """Mean call seconds of every kernel on each CPU alone and on all of them at once (each
    with 1 / ``share`` of the work), ``--rounds`` times."""
    alone: Timings = {k: [] for k in args.kernels}
    together: Timings = {k: [] for k in args.kernels}
    for r in range(args.rounds):
        for kind in args.kernels:
            solo = lambda kind=kind: [run_at_once(kind, [c], args)[0] for c in cpus]  # noqa: E731
            if r % 2 == 0:  # alternate which comes first, against drifts of the machine
                alone[kind].append(solo())
                together[kind].append(run_at_once(kind, cpus, args, share))
            else:
                together[kind].append(run_at_once(kind, cpus, args, share))
                alone[kind].append(solo())
    return alone, together


def report(
    args: argparse.Namespace, cpus: list[int], share: int, alone: Timings, together: Timings
) -> None:
    """The table (medians over the rounds) and what the slowest core allows N ranks."""
    each = f"1/{share} of the work each" if args.split else "the same work each"
    print(
        f"each kernel on each CPU alone, then on CPUs {','.join(map(str, cpus))} at once "
        f"({each}); mean call time, median of {args.rounds} round(s) of {args.seconds:g} s, "
        "milliseconds"
    )
    rows, worst = [], {}
    for kind in args.kernels:
        for i, cpu in enumerate(cpus):
            ratios = [t[i] / a[i] for a, t in zip(alone[kind], together[kind], strict=True)]
            ratio = median(ratios)
            worst[kind] = max(worst.get(kind, 0.0), ratio)
            solo_ms = 1e3 * median([a[i] for a in alone[kind]])
            both_ms = 1e3 * median([t[i] for t in together[kind]])
            rows.append([kind, str(cpu), f"{solo_ms:.3f}", f"{both_ms:.3f}", f"{ratio:.3f}"])
    print(format_table(["kernel", "cpu", "alone", "together", "together/alone"], rows))
    n = len(cpus)
    print()
    for kind, ratio in worst.items():
        doing = "splitting" if args.split else "each doing"
        print(
            f"{kind}: slowest core {ratio:.3f}x its time alone; "
            f"{n} lockstep ranks {doing} only this reach {n / share / ratio:.2f}x one"
        )


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    if not hasattr(os, "sched_setaffinity"):
        ap.error("needs to pin processes to CPUs (os.sched_setaffinity), which this OS lacks")
    allowed = sorted(os.sched_getaffinity(0))
    cpus = allowed if args.cpus is None else args.cpus
    outside = sorted(set(cpus) - set(allowed))
    if outside:
        ap.error(f"--cpus: {outside[0]} is not a CPU this process may use ({allowed})")
    if len(cpus) < 2:
        ap.error(f"--cpus: needs two or more CPUs to compare, got {cpus}")
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // len(cpus)
    m, k, n = args.gemm
    needs = {"gemm": 4 * (m * k + k * n + m * n), "stream": args.stream_mib * 2**20}
    for kind in set(args.kernels) & set(needs):  # refused here, not as a worker's MemoryError
        if needs[kind] > free:
            flag = "--gemm" if kind == "gemm" else "--stream-mib"
            ap.error(f"{flag}: {needs[kind] / 2**30:.1f} GiB a process, {free / 2**30:.1f} free")
    if args.json is not None:
        refuse_unwritable(ap, "--json", args.json)
    share = len(cpus) if args.split else 1
    alone, together = measure(args, cpus, share)
    report(args, cpus, share, alone, together)
    if args.json is not None:
        arguments = {k: v for k, v in vars(args).items() if k not in ("worker", "cpu", "share")}
        arguments["json"] = str(args.json)
        write_json(
            args.json,
            {
                "args": arguments,
                "cpus": cpus,
                "work_share": share,
                "seconds_per_call": {"alone": alone, "together": together},
                "machine": machine_info(),
            },
        )
    return 0


if __name__ == "__main__":
    run_main(main)
