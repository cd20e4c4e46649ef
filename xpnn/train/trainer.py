"""The training loop, the same for 1 or N ranks: their gradients sum to the 1-rank one."""

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from xpnn.data import Dataset, global_batches, shard
from xpnn.data.text import text_metrics
from xpnn.nn.layer import Context
from xpnn.nn.sequential import adding
from xpnn.parallel.comm.narrow import make_wire, sends_gradients
from xpnn.parallel.model.batch_threads import BatchThreads
from xpnn.parallel.model.whole import portion, replicated_ranges, whole_params, whole_size
from xpnn.parallel.plan import Groups, Plan
from xpnn.record.digest import arrays_digest
from xpnn.runtime import stall
from xpnn.runtime.threads import peak_rss_mb
from xpnn.train import midepoch
from xpnn.train.graph import GraphStep, graph_step
from xpnn.train.optim import HYPERS, GradClip, Schedule, make_optimizer, matrix_ranges
from xpnn.train.precision import LossScale, Precision, overflow_skip

# What a resume must match of the network beyond its shapes (``generate`` builds text models)
NETWORK = ("loss", "activation", "layers", "heads", "embed", "block", "vocab")


@dataclass
class RunFacts:
    """What every metrics line says beyond the settings: the resolved ones and the run's finds."""

    said: dict[str, Any] = field(default_factory=dict)
    threads: int | None = None  # BLAS/Numba threads of each rank
    threads_per_rank: list[int] | None = None  # where the ranks' counts differ
    global_batch: int | None = None
    replicas: int | None = None
    preset: dict[str, Any] | None = None  # the settings a model's recipe filled (--model gpt)
    plan: dict[str, Any] | None = None  # the run's layout (``xpnn.parallel.Plan.record``)
    auto: dict[str, Any] | None = None  # what `parallel`/`threads`/`batch_threads` auto chose

    def record(self) -> dict[str, Any]:
        found = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "said"}
        said = {k: v for k, v in self.said.items() if k not in NETWORK}
        return {k: v for k, v in {**said, **found}.items() if v is not None}


@dataclass
class TrainConfig:
    """A resolved ``RunSpec`` read through as attributes, with what the run derives from it."""

    spec: Any  # xpnn.run.RunSpec, its defaults filled; its fields say what each setting means
    batch_size: int  # the global batch: the run's mathematics do not depend on the rank count
    lr: float  # with lr_scaling linear, times the replicas
    eval_batch_size: int = 1000  # the trainer's own: test samples scored a pass
    plan: Plan = field(default_factory=Plan)  # the layout: one process unless a run builds it
    facts: RunFacts = field(default_factory=RunFacts)  # said in every metrics line

    def __getattr__(self, name: str) -> Any:
        if name == "spec":  # not set yet (a copy being made)
            raise AttributeError(name)
        return getattr(self.spec, name)


class TrainingDiverged(RuntimeError):
    """The loss stopped being finite in ``epoch`` (from 1): raised on every rank together."""

    def __init__(self, epoch: int) -> None:
        super().__init__(f"training diverged in epoch {epoch} (the loss is not finite)")
        self.epoch = epoch


def finite(record: dict[str, Any]) -> bool:
    """Whether a record's losses are finite (a diverged span: never checkpointed)."""
    return math.isfinite(record["train_loss"]) and math.isfinite(record["test_loss"])


def warmup_steps(epochs: float, steps_per_epoch: int) -> int:
    """Steps of ``warmup_epochs``: rounded, but at least one when any warmup was asked for."""
    return max(1, round(epochs * steps_per_epoch)) if epochs > 0 else 0


class Trainer:
    def __init__(
        self,
        model: Any,
        data: Dataset,
        backend: Any,
        comm: Any,
        cfg: TrainConfig,
        log: Callable[[str], None] | None = None,
        groups: Groups | None = None,
        callbacks: Sequence["Callback"] = (),
    ) -> None:
        self.model, self.data, self.backend, self.comm, self.cfg = model, data, backend, comm, cfg
        self.xp = backend.xp
        self.log = log or (lambda msg: print(msg, flush=True))
        self.is_root = comm.rank == 0
        self.groups = groups or Groups.of(comm, cfg.plan.spread)
        self.data_comm = self.groups.data  # one rank per replica
        self.model_comm = self.groups.model  # the ranks of one replica
        self.portion = portion(model)
        self.metrics_comm = comm if cfg.plan.pipelined else self.data_comm  # whose losses add up
        self.x_train = self.y_train = self.stream = None  # none in a pipeline's later stages
        if data.windows is not None:  # text: windows of the stream, drawn each step
            self.stream = backend.asarray(data.windows.stream, dtype=self.xp.int64)
        else:
            self.x_train = backend.asarray(data.x_train) if self.portion.reads_input else None
            self.y_train = backend.asarray(data.y_train, dtype=self.xp.int64)
        self.n_train = data.n_train  # with ``replicate``, more than it stores
        self.steps_per_epoch = math.ceil(self.n_train / cfg.batch_size)
        if (warmup := cfg.warmup_steps) is None:
            warmup = warmup_steps(cfg.warmup_epochs, self.steps_per_epoch)
        self.total_steps = cfg.steps or cfg.epochs * self.steps_per_epoch
        self.record_every = (cfg.eval_every or cfg.steps) if cfg.steps else self.steps_per_epoch
        decay_steps = cfg.step_epochs * self.steps_per_epoch  # the decay counts epochs
        args = (cfg.lr, cfg.schedule, warmup, self.total_steps, decay_steps)
        schedule = Schedule(*args, min_lr=cfg.min_lr)
        hyper = {name: getattr(cfg, name) for name in HYPERS}
        matrices = matrix_ranges([tuple(v.shape) for v in model.named_views(model.params).values()])
        shared = replicated_ranges(model, cfg.plan.part(comm.rank))  # counted on another rank

        def total(local: float) -> float:  # this rank's part of a sum to the whole model's
            return float(self.model_comm.allreduce_host([self.update.share_total(local)])[0])

        def optimizer(params: Any, grads: Any, *parts_zeros: Any, offset: int = 0) -> Any:
            """``offset``: where ``params`` starts in the flat buffer (a rank's shard)."""
            moved, skip = ([(lo - offset, hi - offset) for lo, hi in r] for r in (matrices, shared))
            clip = None if cfg.clip_norm is None else GradClip(cfg.clip_norm, total, skip)
            args = (params, grads, backend.kernels, schedule, *parts_zeros)
            return make_optimizer(cfg.optimizer, *args, **hyper, matrices=moved, clip=clip)

        # fp16 passes, or gradients sent as float16 (a node's shared ones are not sent)
        wire_dtype = cfg.grad_dtype if sends_gradients(self.data_comm) else None
        fp16 = cfg.precision == "fp16" or wire_dtype == "float16"
        self.loss_scale: LossScale | None = LossScale() if fp16 else None
        wire = make_wire(wire_dtype, backend.dtype_name, self.xp, lambda: self.loss_scale.scale)
        deferred = cfg.clip_norm is not None or fp16  # fp16: skip overflows
        args = (model, self.data_comm, optimizer, int(cfg.bucket_mb * 2**20), cfg.batch_size)
        kw = {"deferred": deferred, "accumulate": cfg.accumulate, "wire": wire}
        self.update = cfg.plan.make_update(*args, **kw)
        self._acc: Any = None  # the earlier micro-steps' gradients, summed (accumulate > 1)
        self.optimizer = self.update.optimizer
        scale = self.loss_scale if cfg.precision == "fp16" else None
        mixed = cfg.precision != "fp32"
        self.precision = Precision(model, self.optimizer, cfg.precision, scale) if mixed else None
        if self.loss_scale is not None:  # an overflow skips the step, on every rank
            self.optimizer.add_skip_rule(overflow_skip(model, self.xp, self.loss_scale, total))
        # the passes: the model's own, or its twins' over threads each taking part of a batch
        self.passes = BatchThreads(model, cfg.batch_threads) if cfg.batch_threads > 1 else model
        self.graph: GraphStep | None = graph_step(self)  # the step replayed as a CUDA graph
        self.callbacks: list[Callback] = list(callbacks)
        self._step_begin = [c for c in self.callbacks if overrides(c, "on_step_begin")]
        self._step_end = [c for c in self.callbacks if overrides(c, "on_step_end")]
        self.start_epoch = 0  # a resume (``xpnn.train.checkpoint.start``) sets where the run starts
        self.resume_note: str | None = None  # ... and what it says when the run starts
        self.progress = midepoch.EpochProgress()  # ... and a mid-epoch checkpoint's sums
        self.final_params: dict[str, np.ndarray] = {}  # the whole model's, once the run is done

    def batches_done(self) -> int:
        """The batches trained: the optimizer's steps and those fp16 loss scaling skipped."""
        return self.optimizer.step_count + (self.loss_scale.skipped if self.loss_scale else 0)

    def _scores(self, test_loss: float, test_acc: float, rate: float) -> dict[str, Any]:
        """What every record ends with: the test set's scores, the run's facts, fp16's skips."""
        scores = {"test_loss": test_loss, "test_acc": test_acc}
        scores |= text_metrics(self.data, test_loss, test_acc, rate) | self.common
        if self.precision is None and self.loss_scale is None:
            return scores
        return scores | {"skipped_steps": self.loss_scale.skipped if self.loss_scale else 0}

    def step(self, batch: np.ndarray, step: int) -> tuple[Any, Any]:
        """One optimizer step on the global ``batch``, in ``accumulate`` summed micro-steps."""
        xp, model, to_device, seed = self.xp, self.model, self.backend.asarray, self.cfg.seed
        stall.at_step(step)
        if self.graph is not None and (replayed := self.graph.run(batch, step)) is not None:
            return replayed
        self.update.begin_step(len(batch))
        passes = self.precision or self.passes
        micro = np.array_split(batch, self.cfg.accumulate)
        loss = correct = xp.zeros((), dtype=xp.float64)
        summed = False  # whether self._acc holds this step's earlier micro-steps
        for k, part in enumerate(micro):
            last = k == len(micro) - 1
            local = shard(part, self.data_comm.rank, self.data_comm.size)
            if len(local) == 0 and not self.update.needs_every_rank:
                if last:  # more ranks than samples: contribute zeros (or the earlier ones')
                    model.grads[...] = self._acc if summed else 0
                continue
            ready = self.update.grads_ready if last else None
            if last and summed:
                ready = adding(self._acc, model.grads, ready)
            stored = self.data.stored_rows(local)  # others than ``local`` with ``replicate``
            idx = to_device(local, dtype=xp.int64)
            rows = to_device(stored, dtype=xp.int64) if self.data.train_repeats > 1 else idx
            at = None if self.stream is None else self.data.windows.spans(seed, step, stored)
            xb, yb = self.inputs(rows, None if at is None else to_device(at, dtype=xp.int64))
            ctx = Context(train=True, step=step, seed=seed, sample_ids=idx)
            part_loss, part_correct = passes.loss_and_grads(xb, yb, ctx, 1.0 / len(batch), ready)
            loss, correct = loss + part_loss, correct + part_correct
            if not last:
                if self._acc is None:
                    self._acc = xp.zeros_like(model.grads)
                if summed:
                    self._acc += model.grads
                else:
                    self._acc[...] = model.grads
                summed = True
        self.update.finish()
        self.optimizer.end_step()
        return loss, correct

    def inputs(self, rows: Any, at: Any) -> tuple[Any, Any]:
        """Inputs (None: this stage reads none) and labels of ``rows`` (text: windows at ``at``)."""
        xp, reads = self.xp, self.portion.reads_input
        if at is None:
            x = xp.take(self.x_train, rows, axis=0) if reads else None
            return x, xp.take(self.y_train, rows, axis=0)
        flat = xp.reshape(at, (-1,))  # the array API's take: 1-D indices only
        x = xp.reshape(xp.take(self.stream, flat), at.shape) if reads else None
        return x, xp.reshape(xp.take(self.stream, flat + 1), at.shape)

    def _train_step(self, batch: np.ndarray, step: int, sums: dict[str, Any]) -> None:
        """Sums in float64 on the device: a float32 sum drifts, a host sum waits each step."""
        for callback in self._step_begin:
            callback.on_step_begin(self, step)
        loss, correct = self.step(batch, step)
        sums["loss"] += loss
        sums["correct"] += correct
        sums["samples"] += len(batch)
        sums["steps"] += 1
        for callback in self._step_end:
            callback.on_step_end(self, step)

    def bytes_sent(self) -> np.ndarray:
        """This rank's payload bytes handed to MPI: [data group, replica]."""
        return np.array([self.data_comm.bytes_sent, self.model_comm.bytes_sent], np.float64)

    def evaluate(self) -> tuple[float, float]:
        """Test loss and accuracy: each rank scores a contiguous part, sums are reduced."""
        xp, data, dc = self.xp, self.data, self.data_comm
        stall.in_phase("evaluation")
        part = np.array_split(np.arange(data.x_test.shape[0]), dc.size)[dc.rank]
        loss_sum, correct = 0.0, 0.0
        for start in range(0, len(part), self.cfg.eval_batch_size):
            sel = part[start : start + self.cfg.eval_batch_size]
            xb = self.backend.asarray(data.x_test[sel]) if self.portion.reads_input else None
            yb = self.backend.asarray(data.y_test[sel], dtype=xp.int64)
            loss, corr = (self.precision or self.passes).evaluate(xb, yb)
            loss_sum += float(loss)
            correct += float(corr)
        scored = len(part) if self.portion.scores else 0
        total = self.metrics_comm.allreduce_host(np.array([loss_sum, correct, scored], np.float64))
        return total[0] / max(total[2], 1), total[1] / max(total[2], 1)

    def run(self) -> dict:
        cfg, model, comm = self.cfg, self.model, self.comm
        if self.resume_note and self.is_root:
            self.log(self.resume_note)
        self.update.broadcast_initial()  # rank 0's parameters are everyone's
        self.common = {
            "world_size": comm.size,
            "backend": self.backend.name,
            "comm": self.groups.name,
            "model_comm": self.model_comm.name,  # within a replica ("self": one rank holds it)
            "data_comm": self.data_comm.name,  # between replicas ("self": only one replica)
            "update": self.update.name,  # how the replicas' gradients become one update
            **cfg.facts.record(),
        }
        for callback in self.callbacks:
            callback.on_train_begin(self)
        total_seconds, trained, test_loss, test_acc = self._loop()
        stall.in_phase("the end of the run")
        whole = whole_params(model, self.model_comm)  # collective: a replica's pieces gathered
        digests = comm.allgather_obj(arrays_digest(whole.values()))  # equal, or parallelism broke
        peak_rss = comm.allgather_obj(peak_rss_mb())
        rate = trained / max(total_seconds, 1e-9)  # the records' samples over their seconds
        epochs = max(cfg.epochs, self.start_epoch)  # a resumed checkpoint may be further on
        if cfg.steps is not None:  # epochs' worth of batches, as the eval records count them
            epochs = self.batches_done() / self.steps_per_epoch
        done = {
            "event": "done",
            "epochs": epochs,
            "steps": self.optimizer.step_count,
            "total_seconds": total_seconds,
            "samples": trained,
            "samples_per_s": rate,
            "params": whole_size(model),
            "params_sha256": digests[0],
            "ranks_agree": len(set(digests)) == 1,
            "peak_rss_mb": peak_rss,  # by rank: where a pipeline stage or a slice weighs most
        } | self._scores(test_loss, test_acc, rate)
        if self.data.vocab is not None:  # a text set's samples are windows of ``block`` tokens
            done["tokens"] = trained * self.data.x_train.shape[1]
        if self.graph is not None:  # steps replayed from a CUDA graph (the rest ran eagerly)
            done["graph_steps"] = self.graph.replayed
        self.final_params = whole  # what ``SaveParameters`` writes
        for callback in self.callbacks:
            callback.on_train_end(self, done)
        return done

    def _loop(self) -> tuple[float, int, float, float]:
        """The steps left, a record closing each span: (seconds, samples, test loss, accuracy)."""
        cfg, spe = self.cfg, self.steps_per_epoch
        by_steps = cfg.steps is not None
        done = self.batches_done()  # resumed: the steps before its checkpoint are done
        # by epochs, a resumed epoch's record sums its steps before the checkpoint too
        first = done if by_steps else self.start_epoch * spe
        end = self.total_steps
        seconds, trained, record = 0.0, 0, None
        batches: list[np.ndarray] = []
        span: dict[str, Any] | None = None
        for step in range(first, end):
            epoch, index = divmod(step, spe)
            if index == 0 or not batches:
                batches = global_batches(self.n_train, cfg.batch_size, cfg.seed, epoch)
            if span is None:  # the running sums up to the next record, begun by all together
                self.backend.synchronize()
                what = f"step {step + 1}" if by_steps else f"epoch {epoch + 1}"
                stall.in_phase(f"the start of {what}")
                self.comm.barrier()
                t0 = time.perf_counter()
                for callback in () if by_steps else self.callbacks:  # in the epoch's timed span
                    callback.on_epoch_begin(self, epoch)
                span = self.progress.open(self, t0, epoch)
            if step >= done:
                self._train_step(batches[index], step, span)
            else:  # trained before the resumed checkpoint, its sums restored
                span["samples"] += len(batches[index])
                span["steps"] += 1
            if (step + 1) % self.record_every == 0 or step + 1 == end:
                record = self._record(span, step + 1)
                seconds, trained = seconds + record["seconds"], trained + span["samples"]
                span = None
        if record is None:  # resumed with nothing left to train: the result is still said
            return seconds, trained, *self.evaluate()
        return seconds, trained, record["test_loss"], record["test_acc"]

    def train_epoch(self, epoch: int, batches: list[np.ndarray]) -> tuple[Any, Any]:
        """Epoch ``epoch``'s steps left, unrecorded (bench/within_job.py): its sums, on device."""
        sums = self.progress.open(self, time.perf_counter(), epoch)  # or a resume's
        first = epoch * self.steps_per_epoch
        for step in range(max(first, self.batches_done()), first + len(batches)):
            self._train_step(batches[step - first], step, sums)
        return sums["loss"], sums["correct"]

    def _record(self, span: dict[str, Any], step: int) -> dict[str, Any]:
        """The record of ``span`` up to ``step`` for every callback, then the divergence check."""
        by_steps, epoch = self.cfg.steps is not None, (step - 1) // self.steps_per_epoch + 1
        sent = span["sent"] + self.bytes_sent()
        self.backend.synchronize()
        seconds = time.perf_counter() - span["t0"]
        where = f"the evaluation at step {step}" if by_steps else f"the end of epoch {epoch}"
        stall.in_phase(where)
        data_bytes, model_bytes = (int(b) for b in self.comm.allreduce_host(sent))
        mine = np.array([float(span["loss"]), float(span["correct"])])  # float64
        sums = self.metrics_comm.allreduce_host(mine)
        test_loss, test_acc = self.evaluate()
        samples = span["samples"]
        if by_steps:  # epochs' worth of batches, a fraction
            record = {"event": "eval", "step": step, "epoch": step / self.steps_per_epoch}
        else:
            record = {"event": "epoch", "epoch": epoch}
        record |= {
            "train_loss": sums[0] / samples,
            "train_acc": sums[1] / samples,
            "seconds": seconds,
            "samples_per_s": samples / seconds,
            "lr": self.optimizer.schedule(max(0, self.optimizer.step_count - 1)),
            "comm_bytes": data_bytes + model_bytes,
            "comm_bytes_per_step": (data_bytes + model_bytes) / span["steps"],
            "data_comm_bytes": data_bytes,
            "model_comm_bytes": model_bytes,
        } | self._scores(test_loss, test_acc, samples / seconds)
        if self.cfg.clip_norm is not None:  # the span's last step's, before clipping
            record["grad_norm"] = float(self.optimizer.grad_norm)  # a device value: graphs
        event = "on_eval" if by_steps else "on_epoch_end"
        for callback in self.callbacks:  # checkpoints skip a span that diverged
            getattr(callback, event)(self, record)
        if not finite(record):
            for callback in self.callbacks:  # every rank sees it
                callback.on_train_end(self, {"event": "diverged", "epoch": epoch})
            raise TrainingDiverged(epoch)
        return record

    def identity(self) -> dict[str, Any]:
        """What a resume must match beyond shapes, seed and data set (every batch to come)."""
        said = self.cfg.facts.said
        net = {k: said[k] for k in NETWORK if said.get(k) is not None}
        net = {"model": said.get("model"), **net} if "vocab" in net else net
        return {"global_batch": self.cfg.batch_size, "train_samples": self.n_train} | net

    def settings(self) -> dict[str, Any]:
        """What a resume may change and is told about: the rates to come and the precision."""
        cfg = self.cfg
        settings: dict[str, Any] = {"lr": cfg.lr, "schedule": cfg.schedule}
        settings |= {"warmup_epochs": cfg.warmup_epochs, "dtype": self.backend.dtype_name}
        said = {"step_epochs": cfg.schedule == "step", "epochs": cfg.schedule == "cosine"}
        said |= {"min_lr": bool(cfg.min_lr), "precision": cfg.precision != "fp32"}
        optional = (*HYPERS, "warmup_steps", "clip_norm", "grad_dtype")
        said |= {k: getattr(cfg, k) is not None for k in optional}
        for name in (k for k, wanted in said.items() if wanted):  # as JSON gives them: no tuple
            value = getattr(cfg, name)
            settings[name] = list(value) if isinstance(value, tuple) else value
        if cfg.facts.auto is not None:  # a resume keeps it (xpnn.planner.auto.stored_choice)
            settings["auto"] = cfg.facts.auto
        return settings


class Callback:
    """The ``Trainer``'s events on every rank; step events go only to callbacks overriding them."""

    def on_train_begin(self, trainer: Trainer) -> None: ...  # a resume's: before the epochs left
    def on_epoch_begin(self, trainer: Trainer, epoch: int) -> None: ...  # from 0, in its span
    def on_step_begin(self, trainer: Trainer, step: int) -> None: ...  # of the run, from 0
    def on_step_end(self, trainer: Trainer, step: int) -> None: ...  # the next step's parameters
    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None: ...  # docs/cli.md
    def on_eval(self, trainer: Trainer, record: dict[str, Any]) -> None: ...  # by ``eval_every``
    def on_train_end(self, trainer: Trainer, record: dict[str, Any]) -> None: ...  # or diverged


def overrides(callback: Callback, event: str) -> bool:
    return getattr(type(callback), event) is not getattr(Callback, event)
