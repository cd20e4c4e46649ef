"""Training throughput (samples/s) of xpnn's backends, side by side with PyTorch.

One training step is forward + loss + backward + Adam, float32, on random data already in
memory (on the GPU for ``cupy``): loading and host<->device copies are excluded on both sides.
Per model, backend and batch, ``--repeats`` epochs of ``--steps`` steps are timed, each on a
fresh model and optimizer after ``--warmup`` untimed steps. With PyTorch importable, the same
network (Adam with PyTorch's defaults, same batch, threads and dtype; on CUDA for ``cupy``) is
timed in turn, the order flipped every repeat (A B, B A, ...), and xpnn/torch is the median of
the per-repeat ratios, which cancels most of a shared machine's drift.

Every side runs in a worker process of its own (``_throughput_workers``). Each timed epoch
follows ``--gap`` idle seconds, so the thread pools of the side that just ran stop spinning
(a spinning pool takes cores the next side needs), and a pair during which other
processes used more than ``--max-foreign`` cores is timed again once the machine is quiet.

``--graphs`` adds a side per GPU backend whose step is recorded once and replayed as a CUDA
graph (``--cuda-graph``), and ``--torch-compile`` a PyTorch side under
``torch.compile(mode="reduce-overhead")`` (one compilation, warmed up, for every repeat);
each record then has every side's samples/s and the ratios to both PyTorch sides.

``--ranks-compare`` also times ``mpiexec -n RANKS python -m xpnn ... --threads 1`` on synthetic
data (the CLI's whole loop: shuffling and batch gathering included, evaluation excluded)
against one PyTorch process with ``--threads`` threads running the same loop.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.benchmarks._throughput_workers import Unavailable, Worker
from bench.core import (
    BenchError,
    RunFailed,
    epochs_of,
    markdown_table,
    median_of,
    record,
    run_xpnn,
    spread,
)
from bench.flags import (
    choice_list,
    distinct_int_list,
    int_list,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    rank_count,
    timed_epochs,
)
from bench.quiet import add_quiet_flags, busy_warning, load_avg, measure_quietly

NAME = "throughput"
SUMMARY = "training samples/s of xpnn's backends beside PyTorch's (same network, same loop)"
QUICK = {"steps": 2, "warmup": 1, "repeats": 1, "batches": [32], "backends": ["numpy"]}
QUICK |= {"hidden": [64], "max_foreign": 99.0, "gap": 0.0}
STEPS, WARMUP = {"mlp": 50, "cnn": 8}, {"mlp": 10, "cnn": 3}
# A side: (untimed preparation or None, the timed call returning its number).
Side = tuple[Callable[[], Any] | None, Callable[[], float]]


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--model", choices=("mlp", "cnn"), default="mlp", help="mlp: 784-HIDDEN-10; cnn: 690,590 p.")
    a("--hidden", type=int_list, default=[512, 256], help="MLP hidden sizes (default 512,256)")
    a(
        "--backends",
        type=choice_list(("numpy", "numba", "cupy", "torch")),
        default=["numpy", "numba"],
    )
    a("--torch-device", default="cpu", help="backend torch's device and its native side's (cpu)")
    a("--batches", type=distinct_int_list, default=[32, 128, 512], help="default 32,128,512")
    a("--threads", type=positive_int, default=2, help="BLAS/Numba/torch threads per process")
    a("--steps", type=positive_int, help="steps per timed epoch (default mlp 50, cnn 8)")
    a("--warmup", type=positive_int, help="untimed steps of each fresh model (mlp 10, cnn 3)")
    a("--repeats", type=positive_int, default=5, help="timed epochs per side (median)")
    a("--pool", type=positive_int, default=4, help="distinct random batches cycled through")
    a("--seed", type=nonneg_int, default=0)
    a("--gap", type=nonneg_float, default=0.2, help="idle seconds before each timed epoch")
    add_quiet_flags(a, "pair", retries=5, quiet_timeout=120.0)
    a("--no-torch", action="store_true", help="skip the PyTorch side even if importable")
    a("--graphs", action="store_true", help="also xpnn's step replayed as a CUDA graph (cupy)")
    a(
        "--torch-compile",
        action="store_true",
        help='also PyTorch under torch.compile(mode="reduce-overhead") (on CUDA)',
    )
    a("--ranks-compare", action="store_true", help="also: mpiexec -n RANKS x 1 thread vs torch")
    a("--ranks", type=rank_count, default=2, help="ranks for --ranks-compare")
    a("--ranks-samples", type=positive_int, default=2048, help="synthetic train set size")
    a("--ranks-epochs", type=timed_epochs, default=2, help="CLI epochs per run (first dropped)")
    a("--ranks-repeats", type=positive_int, default=3, help="CLI runs, in turn with torch's")
    a("--ranks-batch", type=positive_int, default=128, help="global batch for --ranks-compare")
    a("--timeout", type=positive_float, default=1800, help="seconds per CLI run or worker answer")


def alternate(
    sides: Sequence[Side], repeats: int, args: argparse.Namespace, pids: Sequence[int]
) -> tuple[list[list[float]], list[float | None], int]:
    """``repeats`` rounds of every side in turn, the order flipped each round; each timed call
    after ``--gap`` idle seconds, a round that others disturbed redone (``measure_quietly``).
    Each side's numbers, the cores others used per kept round, and how many rounds were redone.
    """
    numbers: list[list[float]] = [[] for _ in sides]
    foreign, redone = [], 0
    for r in range(repeats):
        order = list(range(len(sides)))[:: 1 if r % 2 == 0 else -1]

        def round_(order: list[int] = order) -> list[float]:
            out = []
            for i in order:
                prepare, timed = sides[i]
                if prepare is not None:
                    prepare()
                time.sleep(args.gap)
                out.append(timed())
            return out

        got, cores, again = measure_quietly(
            round_, args.max_foreign, args.retries, args.quiet_timeout, pids
        )
        foreign.append(cores)
        redone += again
        for i, value in zip(order, got, strict=True):
            numbers[i].append(value)
    return numbers, foreign, redone


def _usable(names: list[str]) -> tuple[list[str], dict[str, str]]:
    from xpnn.backends import availability

    why = availability()
    return [n for n in names if why.get(n) is None], {n: why[n] for n in names if why.get(n)}


def _torch_worker(cfg: dict[str, Any], device: str) -> tuple[Worker | None, str | None]:
    try:
        return Worker("torch", device, cfg), None
    except Unavailable as e:
        return None, str(e)


def _samples(xpnn: list[float], torch: list[float] | None) -> dict[str, list[float]]:
    """The record's metrics from samples/s; a ratio per round of adjacent measurements."""
    if not torch:
        return {"xpnn_samples_per_s": xpnn}
    ratios = [a / b for a, b in zip(xpnn, torch, strict=True)]
    return {"xpnn_samples_per_s": xpnn, "torch_samples_per_s": torch, "xpnn_over_torch": ratios}


# ``--graphs``, ``--torch-compile``: the extra sides, and the ratios their records carry
EXTRA_SIDES = ("xpnn_graph", "torch_compiled")
EXTRA_RATIOS = {
    "graph_over_torch": ("xpnn_graph", "torch"),
    "graph_over_compiled": ("xpnn_graph", "torch_compiled"),
    "xpnn_over_compiled": ("xpnn", "torch_compiled"),
}


def _all_samples(rates: dict[str, list[float]]) -> dict[str, list[float]]:
    """``_samples`` of the xpnn and torch sides, with the extra sides and their ratios."""
    out = _samples(rates["xpnn"], rates.get("torch"))
    out |= {f"{side}_samples_per_s": rates[side] for side in EXTRA_SIDES if side in rates}
    for name, (a, b) in EXTRA_RATIOS.items():
        if a in rates and b in rates:
            out[name] = [x / y for x, y in zip(rates[a], rates[b], strict=True)]
    return out


def sweep(
    args: argparse.Namespace,
    machine: dict[str, Any],
    workers: dict[str, Worker],
    torch_workers: dict[str, Worker | None],
    info: dict[str, Any],
    extra: dict[str, Worker | None] | None = None,
) -> list[dict[str, Any]]:
    """Every batch and backend: the xpnn worker's epochs in turn with torch's on its device
    (and ``extra``'s sides: ``graph-BACKEND``, ``compiled-DEVICE``)."""
    extra = extra or {}
    steps, warmup = args.steps or STEPS[args.model], args.warmup or WARMUP[args.model]
    every = [*workers.values(), *torch_workers.values(), *extra.values()]
    pids = [w.pid for w in every if w]
    out = []
    for batch, (backend, xw) in itertools.product(args.batches, workers.items()):
        device = _native_device(backend, args)
        named = {"xpnn": xw, "xpnn_graph": extra.get(f"graph-{backend}")}
        named |= {"torch": torch_workers.get(device)}
        named |= {"torch_compiled": extra.get(f"compiled-{device}")}
        named = {name: w for name, w in named.items() if w is not None}
        pair = list(named.values())
        for w in pair:
            w.call("setup", batch, args.pool, args.seed)
        sides = [
            (lambda w=w: w.call("fresh", warmup), lambda w=w: w.call("epoch", steps)) for w in pair
        ]
        load = load_avg()
        seconds, foreign, redone = alternate(sides, args.repeats, args, pids)
        rates = [[batch * steps / s for s in side] for side in seconds]
        by_side = dict(zip(named, rates, strict=True))
        config = {"loop": "steps", "model": args.model, "backend": backend, "batch": batch}
        config |= {"threads": args.threads, "steps": steps, "warmup": warmup}
        config |= {"hidden": args.hidden if args.model == "mlp" else None}
        config |= {"torch_device": device if "torch" in named else None}
        config |= {"sides": list(named)} if len(named) > 2 else {}
        noise = {"foreign_cores": foreign, "redone_noisy": redone, "load_avg": [load, load_avg()]}
        r = record(NAME, config, _all_samples(by_side), machine)
        r["info"] = info | noise | {"workers": {w.label: w.info for w in pair}}
        r["info"]["peak_rss_mb"] = _peaks(named)
        out.append(r)
        print(f"  {args.model} {backend} batch {batch}: " + _line(r), flush=True)
    return out


def _peaks(named: dict[str, Worker]) -> dict[str, float]:
    """The xpnn and torch workers' peak resident memory (MiB) after the epochs: each side's
    process holds the same data, its library and its training."""
    peaks = {side: named[side].call("peak_rss_mb") for side in ("xpnn", "torch") if side in named}
    return {side: mb for side, mb in peaks.items() if mb is not None}


def _native_device(backend: str, args: argparse.Namespace) -> str:
    """Where the native PyTorch side runs beside ``backend``: on its device."""
    if backend == "torch":
        return args.torch_device.split(":")[0]
    return "cuda" if backend == "cupy" else "cpu"


def _line(r: dict[str, Any]) -> str:
    x, t, ratio = (median_of(r, m) for m in ("xpnn_samples_per_s", "torch_samples_per_s",
                                              "xpnn_over_torch"))  # fmt: skip
    text = f"xpnn {x:,.0f}" + (f"  torch {t:,.0f}  ratio {ratio:.2f}" if t else "")
    for side in EXTRA_SIDES:
        if side in r["metrics"]:
            text += f"  {side.replace('_', ' ')} {median_of(r, f'{side}_samples_per_s'):,.0f}"
    for name in EXTRA_RATIOS:
        if name in r["metrics"]:
            text += f"  {name.replace('_', ' ')} {median_of(r, name):.2f}"
    most = max((c for c in r["info"]["foreign_cores"] if c is not None), default=None)
    return text + f" samples/s (others used {most} cores at most)"


def ranks_compare(
    args: argparse.Namespace, machine: dict[str, Any], tw: Worker | None, info: dict[str, Any]
) -> dict[str, Any]:
    """``mpiexec -n RANKS python -m xpnn`` (numba, 1 thread a rank) vs one torch process
    running the same loop with ``--threads`` threads, in turn."""
    flags = ["--model", args.model, "--backend", "numba", "--dataset", "synthetic"]
    flags += ["--hidden", ",".join(map(str, args.hidden))] if args.model == "mlp" else []
    flags += ["--synthetic-size", str(args.ranks_samples), "--epochs", str(args.ranks_epochs)]
    flags += ["--batch-size", str(args.ranks_batch), "--threads", "1", "--seed", str(args.seed)]

    def cli() -> float:  # the median samples/s of the epochs after the first (compilation)
        epochs = epochs_of(run_xpnn(args.ranks, flags, args.timeout))[1:]
        if not epochs:
            raise RunFailed(f"python -m xpnn {' '.join(flags)}: no epoch after the first")
        return statistics.median(float(e["samples_per_s"]) for e in epochs)

    sides: list[Side] = [(None, cli)]
    if tw is not None:
        tw.call("cli_data", args.ranks_samples, args.seed)
        tw.call("cli_epoch", args.ranks_batch, 0)  # warm-up
        epoch = itertools.count(1)
        sides.append((None, lambda: tw.call("cli_epoch", args.ranks_batch, next(epoch))))
    pids = [tw.pid] if tw is not None else []
    rates, foreign, redone = alternate(sides, args.ranks_repeats, args, pids)
    config = {"loop": "cli", "model": args.model, "backend": "numba", "batch": args.ranks_batch}
    config |= {"threads": 1, "ranks": args.ranks, "samples": args.ranks_samples}
    config |= {"epochs": args.ranks_epochs, "torch_threads": args.threads if tw else None}
    config |= {"hidden": args.hidden if args.model == "mlp" else None}
    r = record(NAME, config, _samples(rates[0], rates[1] if tw else None), machine)
    r["info"] = info | {"foreign_cores": foreign, "redone_noisy": redone, "command": flags}
    print(f"  {args.model} {args.ranks} ranks x 1 thread (CLI): " + _line(r), flush=True)
    return r


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    backends, skipped = _usable(args.backends)
    if not backends:  # nothing could be measured: say why, and leave the records alone
        why = "; ".join(f"{name}: {reason}" for name, reason in skipped.items())
        raise BenchError(f"--backends: none can run here ({why})")
    torch_skipped = "--no-torch" if args.no_torch else None
    if torch_skipped is None and importlib.util.find_spec("torch") is None:
        torch_skipped = "PyTorch is not importable (pip install torch)"
    for line in [busy_warning(), *(f"{n} skipped: {w}" for n, w in skipped.items())]:
        if line:
            print(line, flush=True)
    if torch_skipped:
        print(f"torch comparison skipped: {torch_skipped}", flush=True)
    cfg = {"threads": args.threads, "model": args.model, "hidden": list(args.hidden)}
    cfg |= {"timeout": args.timeout, "torch_device": args.torch_device}
    info: dict[str, Any] = {"skipped": skipped, "torch_skipped": torch_skipped}
    workers: dict[str, Worker] = {}
    torch_workers: dict[str, Worker | None] = {}
    extra: dict[str, Worker | None] = {}
    try:
        for b in backends:
            workers[b] = Worker("xpnn", b, cfg)
        devices = {_native_device(b, args) for b in backends} | (
            {"cpu"} if args.ranks_compare else set()
        )
        for device in sorted(devices) if torch_skipped is None else []:
            torch_workers[device], why = _torch_worker(cfg, device)
            if why:
                print(f"torch {device} comparison skipped: {why}", flush=True)
                info[f"torch_{device}_skipped"] = why
        extra = _extra_workers(args, backends, cfg, info, torch_skipped)
        records = sweep(args, machine, workers, torch_workers, info, extra)
        if args.ranks_compare:
            records.append(ranks_compare(args, machine, torch_workers.get("cpu"), info))
        return records
    finally:
        for w in [*workers.values(), *torch_workers.values(), *extra.values()]:
            if w is not None:
                w.close()


def _extra_workers(
    args: argparse.Namespace,
    backends: list[str],
    cfg: dict[str, Any],
    info: dict[str, Any],
    torch_skipped: str | None,
) -> dict[str, Worker | None]:
    """``--graphs``: a replaying xpnn worker per backend that records (CuPy); ``--torch-compile``:
    a compiled PyTorch worker per GPU device. A side that cannot run here is said and left out."""
    from xpnn.backends import get_backend

    out: dict[str, Worker | None] = {}
    for backend in backends if args.graphs else []:
        why = get_backend(backend).capture_unavailable() if backend != "cupy" else None
        if why is None:
            out[f"graph-{backend}"] = Worker("xpnn", backend, cfg | {"graph": True})
        else:
            print(f"graphs skipped for {backend}: {why}", flush=True)
            info[f"graph_{backend}_skipped"] = why
    devices = {_native_device(b, args) for b in backends} - {"cpu"}
    for device in sorted(devices) if args.torch_compile and torch_skipped is None else []:
        out[f"compiled-{device}"], why = _torch_worker(cfg | {"compile": True}, device)
        if why:
            print(f"torch {device} compiled comparison skipped: {why}", flush=True)
            info[f"torch_{device}_compiled_skipped"] = why
    return out


EXTRA_HEADS = {
    "xpnn_graph_samples_per_s": "xpnn graph samples/s",
    "torch_compiled_samples_per_s": "torch compiled samples/s",
    "graph_over_torch": "graph/torch",
    "graph_over_compiled": "graph/compiled",
    "xpnn_over_compiled": "xpnn/compiled",
}


def _peak_cells(r: dict[str, Any], sides: list[str]) -> list[str]:
    """A record's workers' peak memory (MiB) for ``sides``, and xpnn's over torch's."""
    got = r.get("info", {}).get("peak_rss_mb", {})
    cells = [f"{got[side]:,.0f}" if side in got else "–" for side in sides]
    if len(sides) > 1:
        both = "xpnn" in got and "torch" in got
        cells.append(f"{got['xpnn'] / got['torch']:.2f}" if both else "–")
    return cells


def table(records: list[dict[str, Any]]) -> str:
    rows = []
    extras = [m for m in EXTRA_HEADS if any(m in r["metrics"] for r in records)]
    seen = [side for r in records for side in r.get("info", {}).get("peak_rss_mb", {})]
    peaks = [side for side in ("xpnn", "torch") if side in seen]
    for r in records:
        c = r["config"]
        backend = c["backend"] + (" (vs cuda)" if c.get("torch_device") == "cuda" else "")
        if c["loop"] == "cli":
            backend = f"{c['backend']} CLI, {c['ranks']} ranks × 1 thread"
        metrics = ("xpnn_samples_per_s", "torch_samples_per_s", "xpnn_over_torch", *extras)
        row = [c["model"], backend, c["batch"], c["threads"], *(spread(r, m) for m in metrics)]
        rows.append(row + _peak_cells(r, peaks))
    heads = ["model", "backend", "batch", "threads", "xpnn samples/s", "torch samples/s"]
    heads += ["xpnn/torch", *(EXTRA_HEADS[m] for m in extras)]
    heads += [f"{side} peak MiB" for side in peaks] + (
        ["peak, xpnn:torch"] if len(peaks) > 1 else []
    )
    text = markdown_table(heads, rows)
    for c in [r["config"] for r in records if r["config"]["loop"] == "cli"][:1]:
        text += f"\n\nCLI row: `mpiexec -n {c['ranks']} python -m xpnn`, synthetic data"
        if c["torch_threads"]:
            text += f", beside one PyTorch process with {c['torch_threads']} threads, same loop"
        text += "."
    return text


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    steps = [r for r in records if r["config"]["loop"] == "steps"]
    for model, backend in sorted({(r["config"]["model"], r["config"]["backend"]) for r in steps}):
        rs = sorted(
            (
                r
                for r in steps
                if (r["config"]["model"], r["config"]["backend"]) == (model, backend)
            ),
            key=lambda r: r["config"]["batch"],
        )
        batches = [r["config"]["batch"] for r in rs]
        ax.plot(batches, [median_of(r, "xpnn_samples_per_s") for r in rs], "o-",
                label=f"xpnn {backend} ({model})")  # fmt: skip
        torch = [median_of(r, "torch_samples_per_s") for r in rs]
        if all(t is not None for t in torch):
            device = rs[0]["config"]["torch_device"]
            ax.plot(batches, torch, "s--", label=f"torch {device} beside {backend} ({model})")
    ax.set_xscale("log", base=2)
    batches = sorted({r["config"]["batch"] for r in steps})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set(yscale="log", xlabel="batch", ylabel="samples/s", title=NAME)
    ax.legend(fontsize=7)
