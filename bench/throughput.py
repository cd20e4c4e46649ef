"""Training throughput (samples/s) of xpnn's backends, side by side with PyTorch.

One training step is forward + loss + backward + Adam update, float32, on random
data that is already in memory (on the GPU for ``cupy``): data loading and
host<->device transfers are *excluded*, on both sides. Per configuration (model,
backend, batch size) the script

* times ``--repeats`` "epochs" of ``--steps`` steps each, each epoch on a fresh
  model and optimizer after ``--warmup`` untimed steps (Numba compilation, thread
  pools, buffer caches, allocators), and reports the median samples/s;
* when PyTorch is importable, times the same network (same layers, Adam with
  PyTorch's default implementation, same batch, same thread count, float32),
  *alternating* xpnn and torch epoch by epoch (the order is flipped every repeat:
  A B, B A, ...), and reports xpnn/torch as the median of the per-repeat ratios,
  which cancels most of the drift of a shared, noisy machine.

Every side runs in a worker process of its own (spawned, idle between requests), as
its users would run it: two libraries' thread pools in one process interfere (an
OpenMP runtime loaded by torch first ignores the ``OMP_WAIT_POLICY=PASSIVE`` that
xpnn's Numba kernels set, and its spinning threads slow OpenBLAS ~10x on 2 cores).
Each timed epoch follows an idle gap (``--gap``) so the pools of the side that just
ran stop spinning, and a pair of epochs during which *other* processes used more
than ``--max-foreign`` cores is timed again once the machine is quiet.

``--backends cupy`` is compared with torch on CUDA (both synchronised before the
clock stops); without a usable GPU it is skipped with a one-line reason.
``--ranks-compare`` also runs ``mpiexec -n 2 python -m xpnn ... --threads 1`` on
synthetic data (whole CLI training loop: shuffling and batch gathering included,
evaluation excluded) against a single PyTorch process with ``--threads`` threads
running the same loop (shuffled batch gather + step).

Run: ``python bench/throughput.py --help``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    RESULTS_DIR,
    DefaultsFormatter,
    Parser,
    RunFailed,
    add_quiet_flags,
    busy_warning,
    choice_list,
    distinct_int_list,
    fmt_num,
    format_table,
    int_list,
    load_avg,
    machine_info,
    measure_quietly,
    median,
    nonneg_float,
    nonneg_int,
    out_path,
    positive_int,
    refuse_unwritable,
    run_job,
    run_main,
    timed_epochs,
    write_json,
)

NAME = "throughput"
ROOT = Path(__file__).resolve().parents[1]
INPUT_SHAPE = (1, 28, 28)
NUM_CLASSES = 10
LR = 1e-3
DEFAULT_STEPS = {"mlp": 50, "cnn": 8}
DEFAULT_WARMUP = {"mlp": 10, "cnn": 3}
# The issues' targets: (model, backend, batch, threads) -> minimum xpnn/torch ratio.
TARGETS: dict[tuple[str, str, int, int], float] = {
    ("mlp", "numba", 128, 2): 1.3,
    ("cnn", "numba", 128, 2): 1.0,
}
RANKS_TARGET = 1.5  # CNN: 2 ranks x 1 thread vs torch 1 process x 2 threads


# --------------------------------------------------------------------------- flags


name_list = choice_list(("numpy", "numba", "cupy"))


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="bench/throughput.py",
        description="Training samples/s of xpnn backends vs PyTorch (forward+backward+Adam).",
        formatter_class=DefaultsFormatter,
    )
    a = p.add_argument
    a("--model", choices=("mlp", "cnn"), default="mlp", help="mlp: 784-HIDDEN-10; cnn: 690,590 p.")
    a("--hidden", type=int_list, default=[512, 256], help="MLP hidden sizes")
    a("--backends", type=name_list, default=["numpy", "numba"], help="comma list")
    a("--batches", type=distinct_int_list, default=[32, 128, 512], help="batch sizes")
    a("--threads", type=positive_int, default=2, help="BLAS/Numba/torch threads")
    a("--steps", type=positive_int, default=None, help="steps per timed epoch (mlp 50, cnn 8)")
    a(
        "--warmup",
        type=positive_int,
        default=None,
        help="untimed steps of a fresh model before each timed epoch (mlp 10, cnn 3); e.g."
        " 1000 measures late-training speed (an aged optimizer state)",
    )
    a("--repeats", type=positive_int, default=5, help="timed epochs per side (median)")
    a("--pool", type=positive_int, default=4, help="distinct random batches cycled through")
    a("--seed", type=nonneg_int, default=0)
    a("--gap", type=nonneg_float, default=0.2, help="idle seconds before each timed epoch")
    add_quiet_flags(a, "pair", retries=5, quiet_timeout=120.0)
    a("--no-torch", action="store_true", help="skip the PyTorch side even if importable")
    a("--ranks-compare", action="store_true", help="also: mpiexec -n 2 x 1 thread vs torch")
    a("--ranks", type=positive_int, default=2, help="ranks for --ranks-compare")
    a("--ranks-samples", type=positive_int, default=2048, help="synthetic train set size")
    a("--ranks-epochs", type=timed_epochs, default=2, help="CLI epochs per run (first dropped)")
    a("--ranks-repeats", type=positive_int, default=3, help="mpiexec runs (alternated with torch)")
    a("--ranks-batch", type=positive_int, default=128, help="global batch for --ranks-compare")
    a(
        "--json",
        type=out_path,
        default=None,
        help=f"JSON file (default {RESULTS_DIR}/{NAME}_MODEL.json)",
    )
    return p


# --------------------------------------------------------------------------- timing core


@dataclass
class Side:
    """One thing to time: ``run(steps)`` trains ``steps`` steps and returns the seconds taken."""

    label: str
    run: Callable[[int], float]
    batch: int
    prepare: Callable[[], object] | None = None  # untimed, before the idle gap
    steps: int = 0
    seconds: list[float] = field(default_factory=list)

    def rates(self) -> list[float]:
        return [self.batch * self.steps / s for s in self.seconds]


@dataclass
class Pacing:
    """How repeats are taken: an idle gap before each timed epoch, and redone when others were
    busy (see ``measure_quietly``); ``pids`` are our worker processes (not "others")."""

    gap_s: float = 0.2
    max_foreign: float = 0.25
    retries: int = 5
    wait_s: float = 120.0
    pids: tuple[int, ...] = ()
    foreign: list[float | None] = field(default_factory=list)
    discarded: int = 0


def alternate(a: Side, b: Side | None, steps: int, repeats: int, pacing: Pacing) -> None:
    """Time ``repeats`` epochs of each side, A B / B A / A B ...; fills ``seconds``.

    Each timed epoch starts after ``gap_s`` of idleness: thread pools (OpenBLAS, OpenMP) spin
    for a while after their last job, and the spinning threads of the side that just ran would
    otherwise steal cores from the next one (measured here: up to 25% on 2 cores). A pair hit
    by another process's work is timed again once the machine is quiet.
    """
    a.steps = steps
    if b is not None:
        b.steps = steps

    def pair(order: list[Side]) -> list[float]:
        out = []
        for side in order:
            if side.prepare is not None:
                side.prepare()
            time.sleep(pacing.gap_s)
            out.append(side.run(steps))
        return out

    for r in range(repeats):
        order = [s for s in ([a, b] if r % 2 == 0 else [b, a]) if s is not None]
        seconds, foreign, discarded = measure_quietly(
            lambda order=order: pair(order),
            pacing.max_foreign,
            pacing.retries,
            pacing.wait_s,
            pacing.pids,
        )
        pacing.foreign.append(foreign)
        pacing.discarded += discarded
        for side, s in zip(order, seconds, strict=True):
            side.seconds.append(s)


def paired_ratios(a: Side, b: Side) -> list[float]:
    """Per-repeat throughput ratios a/b (= time b / time a) of adjacent measurements."""
    return [tb / ta for ta, tb in zip(a.seconds, b.seconds, strict=True)]


def random_batches(n_batches: int, batch: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng([seed, batch])
    return [
        (
            rng.random((batch, *INPUT_SHAPE), dtype=np.float32),
            rng.integers(0, NUM_CLASSES, size=batch, dtype=np.int64),
        )
        for _ in range(n_batches)
    ]


# --------------------------------------------------------------------------- xpnn side


class XpnnTrainer:
    """An xpnn model + Adam on one backend; ``epoch(steps, batches)`` is the timed loop."""

    def __init__(self, backend: Any, model_name: str, hidden: Sequence[int], seed: int) -> None:
        from xpnn.nn import build_model
        from xpnn.optim import Schedule, make_optimizer

        self.backend, self.seed = backend, seed
        self.model = build_model(model_name, tuple(hidden), "relu", NUM_CLASSES)
        self.model.build(INPUT_SHAPE, backend, seed)
        self.opt = make_optimizer(
            "adam", self.model.params, self.model.grads, backend.kernels, Schedule(LR)
        )
        self.params = self.model.size
        self.step_count = 0

    def device_batches(self, host: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple]:
        xp = self.backend.xp
        out = []
        for x, y in host:
            ids = self.backend.asarray(np.arange(len(y)), dtype=xp.int64)
            out.append((self.backend.asarray(x), self.backend.asarray(y, dtype=xp.int64), ids))
        self.backend.synchronize()
        return out

    def epoch(self, steps: int, batches: list[tuple]) -> float:
        from xpnn.nn import Context

        model, opt = self.model, self.opt
        self.backend.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            x, y, ids = batches[i % len(batches)]
            ctx = Context(train=True, step=self.step_count, seed=self.seed, sample_ids=ids)
            model.loss_and_grads(x, y, ctx, 1.0 / len(y))
            opt.step()
            self.step_count += 1
        self.backend.synchronize()
        return time.perf_counter() - t0


# --------------------------------------------------------------------------- torch side


def torch_model(torch: Any, model_name: str, hidden: Sequence[int]) -> Any:
    """The same network as ``xpnn.nn.models``: layer for layer, parameter for parameter."""
    nn = torch.nn
    if model_name == "mlp":
        layers: list = [nn.Flatten()]
        fan_in = int(np.prod(INPUT_SHAPE))
        for h in hidden:
            layers += [nn.Linear(fan_in, h), nn.ReLU()]
            fan_in = h
        layers.append(nn.Linear(fan_in, NUM_CLASSES))
        return nn.Sequential(*layers)
    layers, c_in = [], INPUT_SHAPE[0]
    for c in (32, 128, 256):
        layers += [nn.Conv2d(c_in, c, 3), nn.ReLU(), nn.MaxPool2d(2)]
        c_in = c
    layers += [nn.Flatten(), nn.Dropout(0.5)]
    fan_in = 256  # 28 -> 26 -> 13 -> 11 -> 5 -> 3 -> 1: 256 x 1 x 1
    for d in (1000, 100):
        layers += [nn.Linear(fan_in, d), nn.ReLU()]
        fan_in = d
    layers.append(nn.Linear(fan_in, NUM_CLASSES))
    return nn.Sequential(*layers)


class TorchTrainer:
    """The same network + ``torch.optim.Adam`` (PyTorch's defaults) on ``device``."""

    def __init__(self, torch: Any, model_name: str, hidden: Sequence[int], device: str) -> None:
        self.torch, self.device = torch, device
        self.model = torch_model(torch, model_name, hidden).to(device).train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=LR)
        self.params = sum(p.numel() for p in self.model.parameters())

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def device_batches(self, host: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple]:
        t = self.torch
        out = [(t.from_numpy(x).to(self.device), t.from_numpy(y).to(self.device)) for x, y in host]
        self.sync()
        return out

    def train_step(self, x: Any, y: Any) -> None:
        self.opt.zero_grad(set_to_none=True)
        loss = self.torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()

    def epoch(self, steps: int, batches: list[tuple]) -> float:
        self.sync()
        t0 = time.perf_counter()
        for i in range(steps):
            x, y = batches[i % len(batches)]
            self.train_step(x, y)
        self.sync()
        return time.perf_counter() - t0

    def cli_like_epoch(self, x: Any, y: Any, batch: int, epoch: int) -> float:
        """One epoch as xpnn's CLI runs it: a seeded shuffle, gathered batches, a step each."""
        torch = self.torch
        n = x.shape[0]
        order = torch.from_numpy(np.random.default_rng([0, epoch]).permutation(n))
        t0 = time.perf_counter()
        for start in range(0, n, batch):
            idx = order[start : start + batch]
            self.train_step(x.index_select(0, idx), y.index_select(0, idx))
        return n / (time.perf_counter() - t0)


# --------------------------------------------------------------------------- workers


def worker_main(conn: Any, kind: str, name: str, cfg: dict[str, Any]) -> None:
    """A child process owning one trainer: xpnn on backend ``name``, or torch on device ``name``.

    Each side gets a process of its own, as its users would: thread-pool state does not leak
    from one library into the other. (It does, in one process: an OpenMP runtime loaded by torch
    first ignores the ``OMP_WAIT_POLICY=PASSIVE`` that xpnn's Numba kernels set at import, and
    its spinning threads then slow OpenBLAS ~10x on 2 cores.)
    """
    try:
        from xpnn.runtime import apply_threads

        threads = apply_threads(cfg["threads"])  # before Numba / torch start their pools
        info: dict[str, Any] = {"pid": os.getpid(), "kind": kind, "name": name}
        if kind == "torch":
            import torch

            torch.set_num_threads(cfg["threads"])
            if name == "cuda" and not torch.cuda.is_available():
                conn.send(("ok", {**info, "unavailable": "torch.cuda.is_available() is False"}))
                return

            def make() -> Any:
                return TorchTrainer(torch, cfg["model"], cfg["hidden"], name)

            info.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
        else:
            from xpnn.backends import get_backend

            backend = get_backend(name, "float32")

            def make() -> Any:
                return XpnnTrainer(backend, cfg["model"], cfg["hidden"], 0)

        trainer = make()
        batches: list = []
        data: Any = None
        while True:
            msg = conn.recv()
            op = msg[0]
            if op == "hello":
                out: Any = {**info, "params": trainer.params, "threads": threads}
                if kind == "xpnn" and name == "numba":
                    import numba

                    trainer.epoch(1, trainer.device_batches(random_batches(1, 2, 0)))
                    out["numba_threading_layer"] = numba.threading_layer()
                out["thread_pools"] = thread_pools()
            elif op == "setup":  # (op, batch, pool, seed): this configuration's data
                _, batch, pool, seed = msg
                batches = trainer.device_batches(random_batches(pool, batch, seed))
                out = None
            elif op == "fresh":  # (op, warmup steps)
                # A fresh model and optimizer before every timed epoch, warmed up untimed:
                # - a model's state ages (unflushed, Adam moments turn subnormal after ~650
                #   steps, which slows an update several fold on some CPUs; PyTorch's may), so
                #   every timed epoch covers the same steps (warmup .. warmup + steps) of a run;
                # - one model instance can run 30% faster or slower than the next (memory
                #   placement), an offset that alternating cannot cancel but fresh ones average.
                trainer = make()
                out = trainer.epoch(msg[1], batches)
            elif op == "epoch":
                out = trainer.epoch(msg[1], batches)
            elif op == "cli_data":  # (op, samples, seed): the CLI's synthetic training set
                from xpnn.data import load_dataset

                ds = load_dataset("synthetic", synthetic_size=msg[1], seed=msg[2])
                data = (trainer.torch.from_numpy(ds.x_train), trainer.torch.from_numpy(ds.y_train))
                out = None
            elif op == "cli_epoch":  # (op, batch, epoch)
                out = trainer.cli_like_epoch(data[0], data[1], msg[1], msg[2])
            elif op == "stop":
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown worker request {op!r}")
            conn.send(("ok", out))
    except Exception:
        import traceback

        conn.send(("error", traceback.format_exc()))


def thread_pools() -> list[dict[str, Any]]:
    from threadpoolctl import threadpool_info

    return [
        {"lib": i.get("internal_api"), "api": i.get("user_api"), "threads": i.get("num_threads")}
        for i in threadpool_info()
    ]


class Worker:
    """Parent-side handle of a ``worker_main`` process (spawned: a clean interpreter)."""

    def __init__(self, kind: str, name: str, cfg: dict[str, Any]) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.kind, self.name = kind, name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, kind, name, cfg), daemon=True)
        self.proc.start()
        child.close()
        first = self._recv_if_ended()
        self.info: dict[str, Any] = first if first is not None else self.call("hello")

    def _recv_if_ended(self) -> dict | None:
        """A worker that could not start (e.g. no CUDA for torch) says so and exits."""
        if self.conn.poll(0.0):
            return self._unwrap(self.conn.recv())
        return None

    @staticmethod
    def _unwrap(reply: tuple) -> Any:
        status, value = reply
        if status != "ok":
            raise RuntimeError(f"benchmark worker failed:\n{value}")
        return value

    def call(self, *msg: Any) -> Any:
        self.conn.send(msg)
        try:
            return self._unwrap(self.conn.recv())
        except EOFError:
            raise RuntimeError(f"{self.kind} worker {self.name} died") from None

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop")
            except (RuntimeError, OSError):
                pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()


def start_torch_worker(cfg: dict[str, Any], device: str) -> tuple[Worker | None, str | None]:
    """A torch worker on ``device``, or (None, why not)."""
    w = Worker("torch", device, cfg)
    reason = w.info.get("unavailable")
    if reason:
        w.close()
        return None, reason
    return w, None


# --------------------------------------------------------------------------- main sweep


def check_backends(names: list[str]) -> tuple[list[str], dict[str, str]]:
    """Backends that can run here, and a one-line reason for each that cannot."""
    from xpnn.backends import availability

    avail = availability()
    ok, skipped = [], {}
    for n in names:
        reason = avail.get(n)
        if reason is None:
            ok.append(n)
        else:
            skipped[n] = reason
    return ok, skipped


def sweep(
    args: argparse.Namespace,
    xpnn_workers: dict[str, Worker],
    torch_workers: dict[str, Worker | None],
    torch_notes: dict[str, str | None],
) -> list[dict[str, Any]]:
    steps = args.steps or DEFAULT_STEPS[args.model]
    warmup = args.warmup or DEFAULT_WARMUP[args.model]
    pids = tuple(w.pid for w in [*xpnn_workers.values(), *torch_workers.values()] if w)
    results = []
    for batch in args.batches:
        for b, xw in xpnn_workers.items():
            device = "cuda" if b == "cupy" else "cpu"
            tw = torch_workers.get(device)
            load_before = load_avg()
            sides = []
            for w, label in ((xw, f"xpnn-{b}"), (tw, f"torch-{device}")):
                if w is None:
                    sides.append(None)
                    continue
                w.call("setup", batch, args.pool, args.seed)
                sides.append(
                    Side(
                        label,
                        lambda s, w=w: w.call("epoch", s),
                        batch,
                        prepare=lambda w=w: w.call("fresh", warmup),
                    )
                )
            xside, tside = sides
            assert xside is not None
            pacing = Pacing(args.gap, args.max_foreign, args.retries, args.quiet_timeout, pids)
            alternate(xside, tside, steps, args.repeats, pacing)
            row: dict[str, Any] = {
                "model": args.model,
                "backend": b,
                "batch": batch,
                "threads": args.threads,
                "steps": steps,
                "repeats": args.repeats,
                "xpnn_samples_per_s": median(xside.rates()),
                "xpnn_samples_per_s_all": [round(r, 2) for r in xside.rates()],
                "torch_device": device if tside is not None else None,
                "torch_samples_per_s": None,
                "torch_samples_per_s_all": None,
                "ratio": None,
                "ratios": None,
                "torch_note": torch_notes.get(device),
                "load_avg_before": load_before,
                "load_avg_after": load_avg(),
                "foreign_cores": pacing.foreign,
                "discarded_noisy": pacing.discarded,
            }
            if tside is not None:
                ratios = paired_ratios(xside, tside)
                row.update(
                    torch_samples_per_s=median(tside.rates()),
                    torch_samples_per_s_all=[round(r, 2) for r in tside.rates()],
                    ratio=median(ratios),
                    ratios=[round(r, 4) for r in ratios],
                )
            results.append(row)
            print(
                f"  {args.model} {b:<5} batch {batch:>4}: xpnn {row['xpnn_samples_per_s']:,.0f}"
                + (
                    f"  torch {row['torch_samples_per_s']:,.0f}  ratio {row['ratio']:.2f}"
                    if tside is not None
                    else ""
                )
                + f"  samples/s  (others used {max(pacing.foreign, default=None)} cores at most"
                + f", {pacing.discarded} noisy pairs redone)",
                flush=True,
            )
    return results


# --------------------------------------------------------------------------- ranks compare


def mpiexec_path() -> str | None:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def cli_epoch_rates(metrics: Path) -> list[float]:
    """samples/s of every epoch after the first (the first includes compilation)."""
    lines = [json.loads(s) for s in metrics.read_text().splitlines() if s.strip()]
    epochs = [r for r in lines if r.get("event") == "epoch"]
    if len(epochs) < 2:  # --ranks-epochs is 2 at least: the run stopped early
        raise RuntimeError(f"{metrics}: {len(epochs)} epoch record(s), 2 needed")
    return [float(r["samples_per_s"]) for r in epochs[1:]]


def run_cli_ranks(args: argparse.Namespace, ranks: int, workdir: Path) -> float:
    """One ``mpiexec -n RANKS python -m xpnn`` run: median samples/s of the epochs after the 1st."""
    mpiexec = mpiexec_path()
    if mpiexec is None:
        raise RuntimeError("mpiexec not found")
    metrics = workdir / "metrics.jsonl"
    cmd = [
        mpiexec, "-n", str(ranks), sys.executable, "-m", "xpnn",
        "--model", args.model,
        *(["--hidden", ",".join(map(str, args.hidden))] if args.model == "mlp" else []),
        "--backend", "numba", "--dataset", "synthetic",
        "--synthetic-size", str(args.ranks_samples), "--epochs", str(args.ranks_epochs),
        "--batch-size", str(args.ranks_batch), "--threads", "1", "--seed", str(args.seed),
        "--metrics", str(metrics), "--no-progress",
    ]  # fmt: skip
    run_job(cmd)
    return median(cli_epoch_rates(metrics))


def ranks_compare(args: argparse.Namespace, tw: Worker) -> dict[str, Any]:
    """mpiexec -n R x 1 thread (xpnn CLI, numba) vs one torch process with --threads threads."""
    tw.call("cli_data", args.ranks_samples, args.seed)
    tw.call("cli_epoch", args.ranks_batch, 0)  # warm-up epoch
    xpnn_rates, torch_rates, foreign = [], [], []
    with tempfile.TemporaryDirectory(prefix="xpnn-throughput-") as tmp:
        for r in range(args.ranks_repeats):
            pair = ("xpnn", "torch") if r % 2 == 0 else ("torch", "xpnn")
            for who in pair:
                time.sleep(args.gap)
                if who == "xpnn":
                    fn = lambda: run_cli_ranks(args, args.ranks, Path(tmp))  # noqa: E731
                else:
                    fn = lambda r=r: tw.call("cli_epoch", args.ranks_batch, r + 1)  # noqa: E731
                rate, cores, _ = measure_quietly(
                    fn, args.max_foreign, args.retries, args.quiet_timeout, (tw.pid,)
                )
                (xpnn_rates if who == "xpnn" else torch_rates).append(rate)
                foreign.append(cores)
            print(
                f"  ranks-compare repeat {r + 1}: xpnn {args.ranks}x1 {xpnn_rates[-1]:,.0f}  "
                f"torch 1x{args.threads} {torch_rates[-1]:,.0f} samples/s",
                flush=True,
            )
    ratios = [a / b for a, b in zip(xpnn_rates, torch_rates, strict=True)]
    return {
        "model": args.model,
        "ranks": args.ranks,
        "threads_per_rank": 1,
        "torch_threads": args.threads,
        "samples": args.ranks_samples,
        "global_batch": args.ranks_batch,
        "epochs_per_run": args.ranks_epochs,
        "xpnn_samples_per_s": median(xpnn_rates),
        "xpnn_samples_per_s_all": [round(v, 2) for v in xpnn_rates],
        "torch_samples_per_s": median(torch_rates),
        "torch_samples_per_s_all": [round(v, 2) for v in torch_rates],
        "ratio": median(ratios),
        "ratios": [round(v, 4) for v in ratios],
        "foreign_cores": foreign,
    }


# --------------------------------------------------------------------------- report


def target_lines(results: list[dict], ranks: dict | None) -> list[dict[str, Any]]:
    out = []
    for (model, backend, batch, threads), target in TARGETS.items():
        row = next(
            (
                r
                for r in results
                if (r["model"], r["backend"], r["batch"], r["threads"])
                == (model, backend, batch, threads)
                and r["ratio"] is not None
                and r["torch_device"] == "cpu"
            ),
            None,
        )
        if row is None and not any(r["model"] == model for r in results):
            continue
        out.append(
            {
                "name": f"{model} {backend} vs torch CPU, batch {batch}, {threads} threads",
                "target": target,
                "ratio": None if row is None else row["ratio"],
                "pass": None if row is None else row["ratio"] >= target,
            }
        )
    if ranks is not None and ranks["model"] == "cnn" and ranks["ranks"] == 2:
        out.append(
            {
                "name": f"cnn 2 ranks x 1 thread vs torch 1 process x {ranks['torch_threads']} "
                "threads",
                "target": RANKS_TARGET,
                "ratio": ranks["ratio"],
                "pass": ranks["ratio"] >= RANKS_TARGET,
            }
        )
    return out


def print_report(results: list[dict], ranks: dict | None, targets: list[dict]) -> None:
    headers = ["model", "backend", "batch", "xpnn samples/s", "torch samples/s", "xpnn/torch",
               "ratio min-max"]  # fmt: skip
    rows = []
    for r in results:
        spread = "-"
        if r["ratios"]:
            spread = f"{min(r['ratios']):.2f}-{max(r['ratios']):.2f}"
        rows.append(
            [
                r["model"],
                r["backend"] + ("" if r["torch_device"] in (None, "cpu") else " (vs cuda)"),
                str(r["batch"]),
                f"{r['xpnn_samples_per_s']:,.0f}",
                "-" if r["torch_samples_per_s"] is None else f"{r['torch_samples_per_s']:,.0f}",
                fmt_num(r["ratio"]),
                spread,
            ]
        )
    print()
    print(format_table(headers, rows))
    if ranks is not None:
        print(
            f"\nranks-compare ({ranks['model']}, synthetic {ranks['samples']}, global batch "
            f"{ranks['global_batch']}): xpnn {ranks['ranks']} ranks x 1 thread "
            f"{ranks['xpnn_samples_per_s']:,.0f} samples/s, torch 1 process x "
            f"{ranks['torch_threads']} threads {ranks['torch_samples_per_s']:,.0f} samples/s, "
            f"ratio {ranks['ratio']:.2f} (per-run {ranks['ratios']})"
        )
    if targets:
        print("\ntargets (informational):")
        for t in targets:
            verdict = "not measured" if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
            got = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
            print(f"  {verdict:<12} {t['name']}: {got} (target >= {t['target']})")


def run(args: argparse.Namespace, backends: list[str], skipped: dict[str, str]) -> int:
    warn = busy_warning()
    if warn:
        print(warn, flush=True)
    for name, reason in skipped.items():
        print(f"{name} skipped: {reason}", flush=True)
    torch_reason = "--no-torch" if args.no_torch else None
    if torch_reason is None and importlib.util.find_spec("torch") is None:
        torch_reason = "PyTorch is not importable (pip install torch)"
        print(f"torch comparison skipped: {torch_reason}", flush=True)
    steps = args.steps or DEFAULT_STEPS[args.model]
    print(
        f"{NAME}: {args.model}"
        + (f" 784-{'-'.join(map(str, args.hidden))}-10" if args.model == "mlp" else " (690,590 p.)")
        + f", float32, Adam, {args.threads} threads, {steps} steps x {args.repeats} repeats,"
        " random data in memory (data loading and transfers excluded), one process per side",
        flush=True,
    )
    cfg = {"threads": args.threads, "model": args.model, "hidden": list(args.hidden)}
    xpnn_workers: dict[str, Worker] = {}
    torch_workers: dict[str, Worker | None] = {}
    torch_notes: dict[str, str | None] = {}
    ranks = None
    try:
        for b in backends:
            xpnn_workers[b] = Worker("xpnn", b, cfg)
        if torch_reason is None:
            for device in sorted({"cuda" if b == "cupy" else "cpu" for b in backends}):
                torch_workers[device], torch_notes[device] = start_torch_worker(cfg, device)
                if torch_notes[device]:
                    print(f"torch {device} comparison skipped: {torch_notes[device]}", flush=True)
        results = sweep(args, xpnn_workers, torch_workers, torch_notes) if backends else []
        if args.ranks_compare:
            if torch_reason is not None:
                print(f"ranks-compare skipped: {torch_reason}", flush=True)
            elif mpiexec_path() is None:
                print("ranks-compare skipped: mpiexec not found", flush=True)
            else:
                tw = torch_workers.get("cpu") or start_torch_worker(cfg, "cpu")[0]
                torch_workers["cpu"] = tw
                try:
                    ranks = ranks_compare(args, tw) if tw is not None else None
                except RunFailed as exc:  # was a traceback
                    print(f"throughput: --ranks-compare: {exc}", file=sys.stderr, flush=True)
                    return 1
    finally:
        for w in [*xpnn_workers.values(), *torch_workers.values()]:
            if w is not None:
                w.close()
    targets = target_lines(results, ranks)
    print_report(results, ranks, targets)
    tinfo = next((w.info for w in torch_workers.values() if w is not None), None)
    out = {
        "benchmark": NAME,
        "machine": machine_info(),
        "config": {
            "model": args.model,
            "hidden": args.hidden if args.model == "mlp" else None,
            "backends": args.backends,
            "batches": args.batches,
            "threads": args.threads,
            "steps": steps,
            "warmup": args.warmup or DEFAULT_WARMUP[args.model],
            "repeats": args.repeats,
            "gap_s": args.gap,
            "max_foreign_cores": args.max_foreign,
            "dtype": "float32",
            "optimizer": "adam",
            "data": "random, in memory; loading and transfers excluded",
            "processes": "one worker process per backend and per torch device",
        },
        "workers": {
            f"{w.kind}-{w.name}": w.info
            for w in [*xpnn_workers.values(), *torch_workers.values()]
            if w is not None
        },
        "threads": args.threads,
        "torch": None if tinfo is None else tinfo.get("torch"),
        "torch_threads": None if tinfo is None else tinfo.get("torch_threads"),
        "torch_skipped": torch_reason,
        "torch_notes": torch_notes,
        "skipped": skipped,
        "results": results,
        "ranks_compare": ranks,
        "targets": targets,
    }
    path = json_path(args)
    write_json(path, out)
    print(f"\nwrote {path}")
    return 0


def json_path(args: argparse.Namespace) -> Path:
    return args.json or RESULTS_DIR / f"{NAME}_{args.model}.json"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_unwritable(parser, "--json", json_path(args))
    backends, skipped = check_backends(args.backends)
    if not backends:  # nothing could be measured: say why, and leave the results file alone
        why = "; ".join(f"{name}: {reason}" for name, reason in skipped.items())
        print(f"{parser.prog}: error: --backends: none can run here ({why})", file=sys.stderr)
        return 2
    return run(args, backends, skipped)


if __name__ == "__main__":
    run_main(main)
