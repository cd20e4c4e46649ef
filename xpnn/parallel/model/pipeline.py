"""Pipeline parallelism: stage s of layers of about equal cost on rank s, in micro-batches."""

import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

from xpnn.data.datasets import shard_bounds
from xpnn.errors import UserError
from xpnn.nn.layer import Array, Context, Layer
from xpnn.nn.sequential import LayerError, Sequential, adding
from xpnn.parallel.model.whole import Portion, whole_shape
from xpnn.record import phases
from xpnn.runtime import flight

FORWARD_TAG, BACKWARD_TAG, EVAL_TAG = 1, 2, 3


def layer_costs(layers: list[Layer], shapes: list[tuple[int, ...]]) -> list[float]:
    """Multiply-adds per sample of each layer, of whole parameters (tensor parts cut alike)."""
    costs = []
    for layer, out in zip(layers, shapes[1:], strict=True):
        weights = sum(math.prod(whole_shape(layer, name)) for name in layer.initial)
        costs.append(float(weights * layer.output_positions(out)))
    return costs


def stage_bounds(costs: list[float], has_params: list[bool], stages: int) -> list[tuple[int, int]]:
    """[start, end) layers of ``stages`` stages, the costliest least; each starts with params."""
    starts = [i for i, p in enumerate(has_params) if p]
    if len(starts) < stages:
        raise UserError(
            f"`parallel` pipeline: {stages} stages (a replica's ranks) but the model has only "
            f"{len(starts)} layers with parameters (one stage each at most); use at most "
            f"{len(starts)} ranks a replica (fewer ranks, or `model_ranks`) or `parallel` data"
        )
    cuts = [0, *starts[1:]]  # where a stage may begin
    n = len(costs)
    prefix = [0.0, *itertools.accumulate(costs)]

    def cost(a: int, b: int) -> float:  # layers cuts[a] .. cuts[b] - 1
        return prefix[cuts[b] if b < len(cuts) else n] - prefix[cuts[a]]

    m = len(cuts)

    @functools.cache
    def best(k: int, a: int) -> tuple[float, int]:
        if k == 1:
            return cost(a, m), m
        return min((max(cost(a, b), best(k - 1, b)[0]), b) for b in range(a + 1, m - k + 2))

    bounds, a = [], 0
    for k in range(stages, 0, -1):
        b = best(k, a)[1]
        bounds.append((cuts[a], cuts[b] if b < m else n))
        a = b
    return bounds


Order = list[tuple[str, int]]  # ("F", m): forward micro-batch m; ("B", m): its backward


def gpipe_order(microbatches: int, stages: int, index: int) -> Order:
    """GPipe: every forward, then every backward in reverse; all M micro-batches in flight."""
    forwards = [("F", m) for m in range(microbatches)]
    return forwards + [("B", m) for _, m in reversed(forwards)]


def one_f_one_b_order(microbatches: int, stages: int, index: int) -> Order:
    """PipeDream-Flush (1F1B): S - s - 1 forwards ahead, then a forward and a backward in turn."""
    warm = min(stages - index - 1, microbatches)
    order = [("F", m) for m in range(warm)]
    for j in range(microbatches - warm):
        order += [("F", warm + j), ("B", j)]
    return order + [("B", m) for m in range(microbatches - warm, microbatches)]


SCHEDULES = {"gpipe": gpipe_order, "1f1b": one_f_one_b_order}
DEFAULT_SCHEDULE = "gpipe"


def in_flight(order: Order) -> int:
    """The most micro-batches forwarded and not yet backwarded at once: sets of layers needed."""
    return max(itertools.accumulate(1 if kind == "F" else -1 for kind, _ in order), default=0)


def numbered(method: Callable[..., Any]) -> Callable[..., Any]:
    """A stage's ``method``, a user's layer's error naming its place in the whole network."""

    @functools.wraps(method)
    def run(stage: "PipelineStage", *args: Any, **kw: Any) -> Any:
        try:
            return method(stage, *args, **kw)
        except LayerError as exc:
            raise LayerError(exc.index + stage.layer_start, exc.what) from exc.__cause__

    return run


class PipelineStage(Portion):
    """Stage ``index`` of the whole network, as one process draws it, and its schedule."""

    def __init__(
        self,
        whole: Sequential,
        input_shape: tuple[int, ...],
        backend: Any,
        seed: int,
        index: int,
        stages: int,
        microbatches: int,
        schedule: str = DEFAULT_SCHEDULE,
        recompute: bool = False,
        tensor: tuple[int, int] = (0, 1),
    ) -> None:
        whole.setup(input_shape, backend, seed)
        has_params = [bool(layer.initial) for layer in whole.layers]
        costs = layer_costs(whole.layers, whole.shapes)
        start, end = stage_bounds(costs, has_params, stages)[index]
        self.net = net = Sequential(whole.layers[start:end], whole.loss)
        net.backend, net.xp, net.shapes = whole.backend, whole.xp, whole.shapes[start : end + 1]
        self.layers, self.output_shape = net.layers, net.shapes[-1]
        self.index, self.stages, self.microbatches = index, stages, microbatches
        self.schedule, self.recompute = schedule, recompute
        self.passes = 0  # training passes without a ctx.step: the step that keys dropout
        self.backend, self.xp = whole.backend, whole.xp
        self.layer_start = start  # its first layer's position in the whole model (errors say it)
        self.first, self.last = index == 0, index == stages - 1
        self.part, self.parts = tensor  # stage s part p: rank s * parts + p of the replica
        self.prev_rank, self.next_rank = ((index + d) * self.parts + self.part for d in (-1, 1))
        self.first_param_layer = sum(1 for layer in whole.layers[:start] if layer.initial)
        self.reads_input = self.first  # the others receive activations
        self.scores = self.last and self.part == 0  # once a replica, not once a tensor part
        count = sum(math.prod(whole_shape(x, n)) for x in whole.layers for n in x.initial)
        self.whole_param_count = count
        self.comm: Any = None  # set by ``attach`` once the communicator exists
        self._sets: list[Sequential] = [self.net]  # one set of layers per micro-batch
        self._acc: Array | None = None  # the micro-batches' gradients, summed
        self.train_rows = 0  # the largest batch seen: ``evaluate`` slices by it
        self.net.place()
        self.adopt(self.net.params, self.net.grads, copy=False)

    def adopt(self, params: Array, grads: Array, copy: bool = True) -> None:
        self.net.adopt(params, grads, copy)
        self.params, self.grads, self.size = params, grads, self.net.size
        self.layer_offsets = self.net.layer_offsets

    def param_names(self) -> list[tuple[str, Layer, str]]:
        """The stage's parameters under the whole network's names (``layerN`` counts on)."""
        return [
            (f"layer{self.first_param_layer + i}.{name}", layer, name)
            for i, layer in enumerate(layer for layer in self.layers if layer.initial)
            for name in layer.initial
        ]

    def named_views(self, flat: Array) -> dict[str, Array]:
        views = self.net.named_views(flat).values()
        return {key: view for (key, _, _), view in zip(self.param_names(), views, strict=True)}

    def attach(self, comm: Any) -> None:
        self.net.attach(comm)
        self.comm = comm

    def attach_split(self, comm: Any) -> None:
        """Give the stage's split layers the ranks of its tensor parts (after ``attach``)."""
        self.net.attach(comm)
        self.split_comm = comm

    def _receive(self, rows: int, shape: tuple[int, ...], source: int, tag: int) -> Array:
        buf = self.xp.empty((rows, *shape), dtype=self.params.dtype)
        self.comm.recv_(buf, source, tag)
        return buf

    @numbered
    def loss_and_grads(
        self, x: Array | None, labels: Array, ctx: Context, scale: float, on_grads_ready: Any = None
    ) -> tuple[Array, Array]:
        """A step's micro-batches in the schedule's order; ``x``: the first stage's only."""
        n = labels.shape[0]
        self.train_rows = max(self.train_rows, n)  # every stage sees the batch's labels
        parts = [shard_bounds(n, m, self.microbatches) for m in range(min(n, self.microbatches))]
        # one dropout key per step for every micro-batch: --recompute redraws the same masks
        step = ctx.step
        if step is None:
            step, self.passes = self.passes, self.passes + 1
        ids = self.xp.arange(n, dtype=self.xp.int64) if ctx.sample_ids is None else ctx.sample_ids
        contexts = [
            Context(train=True, step=step, seed=ctx.seed, sample_ids=ids[lo:hi]) for lo, hi in parts
        ]
        loss_sum = correct = self.xp.zeros((), dtype=self.xp.float64)
        order = SCHEDULES[self.schedule](len(parts), self.stages, self.index)
        count = 1 if self.recompute else in_flight(order)
        while len(self._sets) < count:
            self._sets.append(self.net.replica())
        sets = self._sets[:count]
        pending: list[list] = [[] for _ in sets]  # sends still reading each set's buffers
        holder: list[int | None] = [None] * len(sets)  # the micro-batch whose activations it has
        inputs: dict[int, Array] = {}  # recompute: each micro-batch's input, until its backward
        dlogits: dict[int, Array] = {}
        last_backward = max(i for i, (kind, _) in enumerate(order) if kind == "B")
        acc = None
        for i, (kind, m) in enumerate(order):
            (lo, hi), slot = parts[m], m % len(sets)
            net = sets[slot]
            flight.tag(microbatch=m)  # the sends and receives of this micro-batch
            name = f"{'forward' if kind == 'F' else 'backward'} micro-batch {m}"
            with phases.span(name):  # continue and break leave the span too
                if kind == "F":
                    if holder[slot] is not None and not self.recompute:  # backward it first
                        raise RuntimeError(
                            f"pipeline schedule: micro-batch {holder[slot]} in flight"
                        )
                    holder[slot] = m
                    self._wait(pending[slot])
                    if self.first:
                        xin = x[lo:hi]
                    else:
                        xin = self._receive(hi - lo, net.shapes[0], self.prev_rank, FORWARD_TAG)
                    if self.recompute:
                        inputs[m] = xin
                    y = net.forward(xin, contexts[m])
                    if self.last:
                        kernels = self.backend.kernels
                        loss, dlogits[m] = net.loss(kernels, y, labels[lo:hi], scale)
                        if self.scores:
                            correct = correct + kernels.count_correct(y, labels[lo:hi])
                            loss_sum = loss_sum + loss
                    else:
                        pending[slot].append(self.comm.isend(y, self.next_rank, FORWARD_TAG))
                    continue
                if self.last:
                    dy = dlogits.pop(m)
                else:
                    dy = self._receive(hi - lo, self.output_shape, self.next_rank, BACKWARD_TAG)
                if self.recompute and holder[slot] != m:  # the set holds a later micro-batch's
                    self._wait(pending[slot])
                    net.forward(inputs[m], contexts[m])  # activations: m's again
                inputs.pop(m, None)
                final = i == last_backward  # its callback adds the earlier ones', then reports
                ready = on_grads_ready if acc is None else adding(acc, self.grads, on_grads_ready)
                dx = net.backprop(dy, ready if final else None, need_dx=not self.first)  # dy: ours
                holder[slot] = None
                if not self.first:
                    pending[slot].append(self.comm.isend(dx, self.prev_rank, BACKWARD_TAG))
                if final:
                    break
                if acc is not None:
                    acc += self.grads
                    continue
                if self._acc is None:  # the micro-batches' sum: allocated once, reused each step
                    self._acc = self.xp.zeros_like(self.grads)
                acc = self._acc
                acc[...] = self.grads
        flight.tag()
        for handles in pending:
            self._wait(handles)
        return loss_sum, correct

    @staticmethod
    def _wait(handles: list) -> None:
        for handle in handles:
            handle.wait()
        handles.clear()

    @numbered
    def evaluate(self, x: Array | None, labels: Array) -> tuple[Array, Array]:
        """No more rows at once than a training step holds: a test set's activations are big."""
        n, kernels = labels.shape[0], self.backend.kernels
        rows = max(self.train_rows or n, 1)
        loss = correct = self.xp.zeros((), dtype=self.xp.float64)
        for lo in range(0, max(n, 1), rows):
            part = labels[lo : lo + rows]
            if self.first:
                y = x[lo : lo + rows]
            else:
                y = self._receive(part.shape[0], self.net.shapes[0], self.prev_rank, EVAL_TAG)
            y = self.net.forward(y, Context(train=False))
            if not self.last:
                self.comm.isend(y, self.next_rank, EVAL_TAG).wait()
            if self.scores:  # neither an earlier stage nor another tensor part of the last
                loss = loss + self.net.loss(kernels, y, part, 1.0)[0]
                correct = correct + kernels.count_correct(y, part)
        return loss, correct

    def summary(self) -> str:
        recompute = ", recompute" if self.recompute else ""
        run = f"{self.microbatches} micro-batch(es), {self.schedule}{recompute}"
        said = f"{self.size:,} parameters; stage {self.index} of {self.stages} stage(s), {run}"
        return " -> ".join(repr(layer) for layer in self.layers) + f"  ({said})"


build_stage = PipelineStage  # stage ``index`` of ``stages``, from the whole unbuilt network
