"""The worker processes of ``throughput``: one per xpnn backend and per PyTorch device.

Each side trains in a spawned interpreter of its own, as its users would run it: two
libraries' thread pools in one process interfere (an OpenMP runtime loaded by torch first
ignores the ``OMP_WAIT_POLICY=PASSIVE`` that xpnn's Numba kernels set at import, and its
spinning threads slow OpenBLAS ~10x on 2 cores). A worker idles between requests.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.core import RunFailed

INPUT_SHAPE = (1, 28, 28)
NUM_CLASSES = 10
LR = 1e-3


class Unavailable(Exception):
    """The side cannot run here (torch without CUDA); the message says why."""


def random_batches(n: int, batch: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng([seed, batch])
    x = [rng.random((batch, *INPUT_SHAPE), dtype=np.float32) for _ in range(n)]
    return [(xi, rng.integers(0, NUM_CLASSES, size=batch, dtype=np.int64)) for xi in x]


class XpnnTrainer:
    """An xpnn model + Adam on one backend; ``epoch(steps, batches)`` is the timed loop.
    ``graph``: the step recorded once and replayed (``--cuda-graph``'s ``Recorder``), each
    batch first copied into the recording's static input buffers."""

    def __init__(self, backend: Any, model: str, hidden: Sequence[int], graph: bool = False):
        from xpnn.nn import build_model
        from xpnn.train.optim import Schedule, make_optimizer

        self.backend = backend
        self.model = build_model(model, tuple(hidden), "relu", NUM_CLASSES)
        self.model.build(INPUT_SHAPE, backend, 0)
        m = self.model
        self.opt = make_optimizer("adam", m.params, m.grads, backend.kernels, Schedule(LR))
        self.params, self.step = m.size, 0
        self.recorder: Any = None
        self.static: tuple | None = None  # the recording's input buffers
        if graph:
            from xpnn.backends import StepScalars
            from xpnn.train import Recorder

            self.scalars = StepScalars(backend)
            self.recorder = Recorder(backend.capture, self.opt, self.scalars, [self._recorded])

    def _recorded(self) -> None:
        """The step the recorder records: on the static inputs, the step's numbers on device."""
        from xpnn.nn import Context

        x, y, ids = self.static
        ctx = Context(train=True, step=self.scalars.step, seed=0, sample_ids=ids)
        self.model.loss_and_grads(x, y, ctx, 1.0 / len(y))
        self.opt.step()

    def _replay(self, x: Any, y: Any, ids: Any) -> None:
        if self.static is None:
            self.static = (x.copy(), y.copy(), ids.copy())
        self.static[0][...] = x  # device to device, as PyTorch's graphs copy their inputs
        self.static[1][...] = y
        for run in self.recorder.begin(self.step):
            run()

    def device_batches(self, host: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple]:
        b, i64 = self.backend, self.backend.xp.int64
        out = [(b.asarray(x), b.asarray(y, dtype=i64), b.asarray(np.arange(len(y)), dtype=i64))
               for x, y in host]  # fmt: skip
        b.synchronize()
        return out

    def epoch(self, steps: int, batches: list[tuple]) -> float:
        from xpnn.nn import Context

        self.backend.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            x, y, ids = batches[i % len(batches)]
            if self.recorder is not None:
                self._replay(x, y, ids)
            else:
                ctx = Context(train=True, step=self.step, seed=0, sample_ids=ids)
                self.model.loss_and_grads(x, y, ctx, 1.0 / len(y))
                self.opt.step()
            self.step += 1
        self.backend.synchronize()
        return time.perf_counter() - t0


def torch_model(torch: Any, model: str, hidden: Sequence[int]) -> Any:
    """The same network as ``xpnn.nn.models``: layer for layer, parameter for parameter."""
    nn = torch.nn
    if model == "mlp":
        layers: list = [nn.Flatten()]
        widths = [int(np.prod(INPUT_SHAPE)), *hidden]
    else:
        layers, c_in = [], INPUT_SHAPE[0]
        for c in (32, 128, 256):
            layers += [nn.Conv2d(c_in, c, 3), nn.ReLU(), nn.MaxPool2d(2)]
            c_in = c
        layers += [nn.Flatten(), nn.Dropout(0.5)]
        widths = [256, 1000, 100]  # 28 -> 26 -> 13 -> 11 -> 5 -> 3 -> 1: 256 x 1 x 1
    for a, b in zip(widths, widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], NUM_CLASSES))


class TorchTrainer:
    """The same network + ``torch.optim.Adam`` (PyTorch's defaults) on ``device``;
    ``compiled``: the network under ``torch.compile(mode="reduce-overhead")`` (forward and
    backward compiled and replayed as CUDA graphs), the optimizer as it is."""

    def __init__(
        self, torch: Any, model: str, hidden: Sequence[int], device: str, compiled: bool = False
    ) -> None:
        self.torch, self.device, self.compiled = torch, device, compiled
        self.model = torch_model(torch, model, hidden).to(device).train()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=LR)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.forward = torch.compile(self.model, mode="reduce-overhead") if compiled else self.model

    def sync(self) -> None:
        if self.device != "cpu":
            getattr(self.torch, self.device).synchronize()

    def device_batches(self, host: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple]:
        t = self.torch
        out = [(t.from_numpy(x).to(self.device), t.from_numpy(y).to(self.device)) for x, y in host]
        self.sync()
        return out

    def train_step(self, x: Any, y: Any) -> None:
        if self.compiled:  # a new step: the graphs' earlier outputs may be overwritten
            self.torch.compiler.cudagraph_mark_step_begin()
        self.opt.zero_grad(set_to_none=True)
        self.torch.nn.functional.cross_entropy(self.forward(x), y).backward()
        self.opt.step()

    def epoch(self, steps: int, batches: list[tuple]) -> float:
        self.sync()
        t0 = time.perf_counter()
        for i in range(steps):
            self.train_step(*batches[i % len(batches)])
        self.sync()
        return time.perf_counter() - t0

    def cli_like_epoch(self, x: Any, y: Any, batch: int, epoch: int) -> float:
        """One epoch as xpnn's CLI runs it (a seeded shuffle, gathered batches): samples/s."""
        order = self.torch.from_numpy(np.random.default_rng([0, epoch]).permutation(len(x)))
        t0 = time.perf_counter()
        for start in range(0, len(x), batch):
            idx = order[start : start + batch]
            self.train_step(x.index_select(0, idx), y.index_select(0, idx))
        return len(x) / (time.perf_counter() - t0)


class Service:
    """What a worker does on request: each public method is one request."""

    def __init__(self, kind: str, name: str, cfg: dict[str, Any]) -> None:
        from threadpoolctl import threadpool_info

        from xpnn.runtime import apply_threads

        limited = apply_threads(cfg["threads"])  # before Numba / torch start their pools
        self.kind, self.name, self.cfg = kind, name, cfg
        self.info: dict[str, Any] = {"pid": os.getpid(), "threads": limited}
        if kind == "torch":
            import torch

            torch.set_num_threads(cfg["threads"])
            if name != "cpu" and not getattr(torch, name).is_available():
                raise Unavailable(f"torch.{name}.is_available() is False")
            self.torch = torch
            self.info |= {"torch": torch.__version__, "torch_threads": torch.get_num_threads()}
        else:
            from xpnn.backends import get_backend

            device = cfg.get("torch_device") if name == "torch" else None
            self.backend = get_backend(name, "float32", device=device)
            self.info["device"] = self.backend.device
        self.trainer = self._make()
        self.batches: list = []
        if cfg.get("compile"):  # compiled once now: a toolchain that fails skips this side
            try:
                self.trainer.epoch(2, self.trainer.device_batches(random_batches(1, 2, 0)))
            except Exception as exc:
                lines = str(exc).strip().splitlines() or [type(exc).__name__]
                raise Unavailable(f"torch.compile failed: {lines[-1]}") from None
        if name == "numba":  # compile now, then say which threading layer Numba chose
            import numba

            self.trainer.epoch(1, self.trainer.device_batches(random_batches(1, 2, 0)))
            self.info["numba_threading_layer"] = numba.threading_layer()
        pools = [(p.get("internal_api"), p.get("num_threads")) for p in threadpool_info()]
        self.info |= {"params": self.trainer.params, "thread_pools": pools}

    def _make(self) -> Any:
        model, hidden = self.cfg["model"], self.cfg["hidden"]
        if self.kind == "torch":
            compiled = bool(self.cfg.get("compile"))
            if compiled and getattr(self, "trainer", None) is not None:
                return self.trainer  # one compilation (tens of seconds) serves every repeat
            return TorchTrainer(self.torch, model, hidden, self.name, compiled)
        return XpnnTrainer(self.backend, model, hidden, bool(self.cfg.get("graph")))

    def setup(self, batch: int, pool: int, seed: int) -> None:
        """This configuration's data, on the side's device."""
        self.batches = self.trainer.device_batches(random_batches(pool, batch, seed))

    def fresh(self, warmup: int) -> float:
        """A fresh model and optimizer, warmed up untimed, before every timed epoch: a model's
        state ages (Adam moments turn subnormal after ~650 steps, which slows an update several
        fold on some CPUs), so every timed epoch covers the same steps of a run; and one model
        instance can run 30% faster or slower than the next (memory placement), an offset that
        alternating cannot cancel but fresh ones average."""
        if not self.cfg.get("compile"):  # the old model freed first: the peak is one model's
            self.trainer = None
        self.trainer = self._make()
        return self.trainer.epoch(warmup, self.batches)

    def epoch(self, steps: int) -> float:
        return self.trainer.epoch(steps, self.batches)

    def peak_rss_mb(self) -> float | None:
        """This worker's peak resident memory so far (MiB): its library, data and training."""
        from xpnn.runtime import peak_rss_mb

        return peak_rss_mb()

    def cli_data(self, samples: int, seed: int) -> None:
        """The CLI's synthetic training set, for ``cli_epoch``."""
        from xpnn.data import load_dataset

        ds = load_dataset("synthetic", synthetic_size=samples, seed=seed)
        self.data = (self.torch.from_numpy(ds.x_train), self.torch.from_numpy(ds.y_train))

    def cli_epoch(self, batch: int, epoch: int) -> float:
        return self.trainer.cli_like_epoch(*self.data, batch, epoch)


def serve(conn: Any, kind: str, name: str, cfg: dict[str, Any]) -> None:
    """The worker's loop: its info first, then one reply per request until ``stop``."""
    try:
        service = Service(kind, name, cfg)
        conn.send(("ok", service.info))
        while (msg := conn.recv())[0] != "stop":
            conn.send(("ok", getattr(service, msg[0])(*msg[1:])))
    except Unavailable as e:
        conn.send(("unavailable", str(e)))
    except Exception:  # the parent reports it as a failed run, with the worker's traceback
        conn.send(("error", traceback.format_exc()))


class Worker:
    """Parent-side handle of a ``serve`` process (spawned: a clean interpreter)."""

    def __init__(self, kind: str, name: str, cfg: dict[str, Any]) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        variant = "-graph" if cfg.get("graph") else "-compiled" if cfg.get("compile") else ""
        self.label = f"{kind}-{name}{variant}"
        self.timeout = float(cfg.get("timeout", 1800))  # a hung worker (a CUDA hang) ends the run
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, kind, name, cfg), daemon=True)
        self.proc.start()
        child.close()
        try:
            self.info: dict[str, Any] = self._reply()
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return int(self.proc.pid or 0)

    def _reply(self) -> Any:
        if not self.conn.poll(self.timeout):
            raise RunFailed(f"the {self.label} worker gave no answer in {self.timeout:g} s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise RunFailed(f"the {self.label} worker died") from None
        if status == "unavailable":
            raise Unavailable(value)
        if status != "ok":
            raise RunFailed(f"the {self.label} worker failed:\n{value.strip()}")
        return value

    def call(self, op: str, *args: Any) -> Any:
        self.conn.send((op, *args))
        return self._reply()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
