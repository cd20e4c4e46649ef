"""The cost model: a step's time and a rank's memory under a layout (docs/planning.md)."""

import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from xpnn.parallel.update.base import MIN_LAYER_BUCKET, layer_buckets
from xpnn.planner.machine import Machine
from xpnn.planner.work import DGRAD, FORWARD, PHASES, WGRAD, LayerWork, ModelWork
from xpnn.train.optim import OPTIMIZERS

TIMES = (*PHASES, "elementwise")
BUCKET_BYTES = 4 << 20  # a data-parallel step's gradient bucket, as priced


def optimizer_states(name: str) -> int:
    """Buffers of the parameters' size the optimizer keeps (Adam: 2), from its registry."""
    return len(OPTIMIZERS[name].state_names) if name in OPTIMIZERS else 2


@dataclass(frozen=True)
class Layout:
    """A candidate layout: ``ranks`` processes of ``threads`` threads, split as ``parallel``."""

    ranks: int = 1
    threads: int = 1
    parallel: str = "data"
    batch_threads: int = 1
    microbatches: int = 1
    schedule: str = "gpipe"
    comm: str = "mpi-host"
    nodes: int = 1  # ``ranks`` spread evenly over this many nodes of the calibrated shape

    @property
    def local_ranks(self) -> int:
        return max(1, self.ranks // max(1, self.nodes))

    @property
    def node_shared(self) -> bool:
        """Whether data-parallel ranks sum on their node's shared memory (``mpi-shm``)."""
        return self.parallel == "data" and self.comm in ("auto", "mpi-shm") and self.ranks > 1

    def flags(self) -> list[str]:
        """The command-line flags that run this layout (``mpiexec -n ranks`` around them)."""
        out = ["--threads", str(self.threads)]
        if self.ranks > 1:
            out = ["--parallel", self.parallel, *out, "--comm", self.comm]
        if self.batch_threads > 1 or self.threads > 1:  # explicit: a preset may default to auto
            out += ["--batch-threads", str(self.batch_threads)]
        if self.parallel == "pipeline":
            out += ["--microbatches", str(self.microbatches), "--pipeline-schedule", self.schedule]
        return out

    def describe(self) -> str:
        text = f"{self.ranks} rank(s) x {self.threads} thread(s)"
        if self.ranks > 1:
            text += f", {self.parallel}"
        if self.parallel == "pipeline":
            text += f" ({self.microbatches} micro-batches, {self.schedule})"
        if self.batch_threads > 1:
            text += f", {self.batch_threads} batch threads"
        if self.nodes > 1:
            text += f", over {self.nodes} nodes"
        return text


@dataclass
class Prediction:
    """Seconds per step by cause, and bytes per rank."""

    layout: Layout
    forward: float = 0.0
    wgrad: float = 0.0
    dgrad: float = 0.0
    elementwise: float = 0.0
    optimizer: float = 0.0
    comm_exposed: float = 0.0
    comm_hidden: float = 0.0
    bubble: float = 0.0
    serial_tail: float = 0.0
    sync_wait: float = 0.0  # oversubscribed ranks' turns at each synchronization
    syncs: int = 0  # the step's synchronizations (fences or collectives) a rank waits in
    slowdown: float = 1.0
    memory: dict[str, float] = field(default_factory=dict)
    samples: int = 0
    tokens_per_sample: int = 1

    @property
    def step(self) -> float:
        return sum(self._parts().values())

    @property
    def rate(self) -> float:
        """Samples (or tokens, for text) per second."""
        return self.samples * self.tokens_per_sample / self.step

    def _parts(self) -> dict[str, float]:
        return {
            "compute": self.forward + self.wgrad + self.dgrad,
            "elementwise": self.elementwise,
            "optimizer": self.optimizer,
            "communication": self.comm_exposed,
            "pipeline bubble": self.bubble,
            "batch threads' serial tail": self.serial_tail,
            "waiting for a core at each synchronization": self.sync_wait,
        }

    def largest(self) -> str:
        parts = self._parts()
        name = max(parts, key=parts.get)
        return f"{name} {100 * parts[name] / self.step:.0f}%"

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)  # the layout after the costs
        out |= {"layout": out.pop("layout"), "flags": self.layout.flags(), "step_s": self.step}
        return out | {"rate": self.rate, "largest": self.largest()}


def compute_times(
    machine: Machine, work: ModelWork, batch: int, threads: int, dtype: str, split: int = 1
) -> dict[str, float]:
    """Each phase's product time and the passes' for ``batch`` samples, ``n`` cut ``split`` ways."""
    out = dict.fromkeys(PHASES, 0.0)
    for g in work.gemms():
        m, k, n, count = g.at(batch)
        out[g.phase] += machine.gemm_seconds(m, k, max(1, n // split), count, threads, dtype)
    if threads in work.rest:  # measured on the model itself
        per_step = work.rest_per_step.get(threads, 0.0)
        out["elementwise"] = (per_step + work.rest[threads] * batch) / split
    else:
        values = work.elementwise() * batch / split
        out["elementwise"] = values / machine.values_per_s(threads, dtype)
    return out


def memory(
    work: ModelWork, layout: Layout, batch: int, optimizer: str, itemsize: int, shard: bool = False
) -> dict[str, float]:
    """Bytes per rank: parameters, gradients, optimizer state, ``batch``'s activations kept."""
    parts = layout.ranks if layout.parallel in ("tensor", "pipeline") else 1
    params = work.params / parts
    states = optimizer_states(optimizer) * params
    if shard and layout.parallel == "data":
        states /= layout.ranks
    activations = work.elementwise() / 3 * batch / parts  # outputs kept per sample
    grads = params * layout.batch_threads  # each twin has its own gradients
    return {
        "parameters": params * itemsize,
        "gradients": grads * itemsize,
        "optimizer": states * itemsize,
        "activations": activations * itemsize,
    }


def predict(
    machine: Machine,
    work: ModelWork,
    layout: Layout,
    batch: int,
    optimizer: str = "adam",
    dtype: str = "float32",
    shard_optimizer: bool = False,
    node_share: str = "auto",
) -> Prediction:
    """One step of ``batch`` samples (the global batch) under ``layout``."""
    itemsize = 8 if dtype == "float64" else 4
    r, t, k = layout.ranks, layout.threads, layout.batch_threads
    local = layout.local_ranks
    pred = Prediction(layout, samples=batch, tokens_per_sample=work.tokens_per_sample)
    pred.slowdown = machine.slowdown(local * t)
    grads_bytes = work.params * itemsize
    share = r  # the ranks a parameter's update is divided among: a tensor part's, a stage's
    if layout.parallel == "data" or r == 1:
        phases = compute_times(machine, work, math.ceil(batch / (r * k)), t // k, dtype)
        if k > 1:  # the twins' gradients summed by the main thread
            pred.serial_tail = (k - 1) * work.params / machine.values_per_s(t, dtype)
        backward = phases[WGRAD] + phases[DGRAD]
        if layout.node_shared and not shard_optimizer:
            comm, last = _node_shared(machine, work, batch, dtype, node_share, pred)
            share = local
        else:
            share = r if shard_optimizer else 1
            comm, last = _data_comm(machine, layout, grads_bytes, shard_optimizer)
            pred.syncs = math.ceil(grads_bytes / BUCKET_BYTES) + 1 if r > 1 else 0
        pred.comm_exposed = last + max(0.0, comm - last - backward)
        pred.comm_hidden = comm - pred.comm_exposed
        batch_rank = math.ceil(batch / r)
    elif layout.parallel == "tensor":  # the pairs and heads split, the other layers whole
        cut = {id(layer) for pair in dense_pairs(work) for layer in pair}
        cut |= {id(layer) for layer in work.layers if layer.name.endswith(".heads")}
        per_layer = layer_times(machine, work, batch, t, dtype, lambda x: r if id(x) in cut else 1)
        phases = {name: sum(p[name] for p in per_layer) for name in TIMES}
        sizes = tensor_allreduces(work, batch, itemsize)
        for nbytes in sizes:
            pred.comm_exposed += machine.collective("allreduce", local, nbytes)
            pred.comm_exposed += network_allreduce(machine, layout.nodes, nbytes)
        pred.syncs = len(sizes)
        batch_rank = batch
    else:  # pipeline: each rank a stage; the slowest stage paces every micro-batch
        m = layout.microbatches
        micro = math.ceil(batch / m)
        stages = _stage_times(machine, work, r, micro, t, dtype)
        slowest = max(stages, key=lambda phases: sum(phases.values()))
        phases = {name: slowest.get(name, 0.0) * m for name in TIMES}
        pred.bubble = (r - 1) * sum(slowest.values())
        forward = [g.n for g in work.gemms() if g.phase == FORWARD and g.scales == "m"]
        act_bytes = micro * max(forward, default=1) * max(1, work.tokens_per_sample) * itemsize
        pred.comm_exposed = 2 * (m + r - 1) * _stage_send(machine, layout, act_bytes)
        pred.syncs = 2 * (m + r - 1)
        batch_rank = micro if layout.schedule == "1f1b" else batch
    # each parameter and its gradient read, the parameter written, each state read and written
    values = (3 + 2 * optimizer_states(optimizer)) * (work.params / share)
    pred.optimizer += values / machine.values_per_s(t, dtype)
    alone = sum(phases[name] for name in TIMES) + pred.optimizer
    if pred.syncs:  # each rank's compute alone between two of its synchronizations
        pred.sync_wait = pred.syncs * machine.sync_wait(local * t, alone / pred.syncs)
    for name in TIMES:
        setattr(pred, name, phases[name] * pred.slowdown)
    pred.bubble *= pred.slowdown
    pred.optimizer *= pred.slowdown
    pred.memory = memory(work, layout, batch_rank, optimizer, itemsize, shard_optimizer)
    return pred


def network_allreduce(machine: Machine, nodes: int, nbytes: float, messages: int = 1) -> float:
    """A ring allreduce over ``nodes``: 2 (N - 1) alphas a message, 2 (N - 1) / N of ``nbytes``."""
    if nodes <= 1 or nbytes <= 0:
        return 0.0
    alpha, beta = machine.network_cost()
    return messages * 2 * (nodes - 1) * alpha + 2 * (nodes - 1) / nodes * nbytes * beta


def param_buckets(work: ModelWork) -> int:
    """How many buckets a node-shared update cuts the parameters into (the update's own cut)."""
    sizes = [layer.params for layer in work.layers if layer.params]
    offsets = [0, *itertools.accumulate(sizes)][:-1]
    return len(layer_buckets(offsets, work.params, MIN_LAYER_BUCKET))


def _dense_values(work: ModelWork) -> int:
    """Values a sample puts in a node's shared activations: Dense inputs and output gradients."""
    return sum(g.k + g.n for g in work.gemms() if g.phase == FORWARD and g.scales == "m")


def shares_activations(work: ModelWork, batch: int, node_share: str) -> bool:
    """Whether a node's ranks share activations, not gradients (as ``node_share`` or the update)."""
    with_params = [layer for layer in work.layers if layer.params]
    all_dense = bool(with_params) and all("Dense" in layer.name for layer in with_params)
    if node_share == "gradients" or not all_dense:
        return False
    return node_share == "activations" or batch * _dense_values(work) < work.params


def _node_shared(
    machine: Machine, work: ModelWork, batch: int, dtype: str, node_share: str, pred: Prediction
) -> tuple[float, float]:
    """(a node-shared update's exchange, its last bucket's part): fences, others' shares read."""
    local, nodes, t = pred.layout.local_ranks, pred.layout.nodes, pred.layout.threads
    itemsize = 8 if dtype == "float64" else 4
    buckets = param_buckets(work)
    fences = buckets + 1
    if nodes > 1 and node_share == "auto":
        node_share = "gradients"  # a run's default across nodes (xpnn.run)
    others = (local - 1) / local  # the part of a shared array the other ranks wrote
    if activations := shares_activations(work, batch, node_share):
        fences += 2 * (sum(1 for layer in work.layers if layer.params) - 1)
        read = others * batch / nodes * _dense_values(work) * itemsize
    else:
        read = others * work.params * itemsize
    pred.syncs = fences
    cross = network_allreduce(machine, nodes, work.params * itemsize, buckets)
    fence = machine.shared_exchange(local, 0.0)
    if fence is None:  # not measured: a node barrier, the rows read at the passes' rate
        crowded = local * t > machine.cores  # its fences are its synchronizations' waits
        fence = 0.0 if crowded else machine.collective("allreduce", local, itemsize)
        if not activations:
            pred.optimizer += read / itemsize / machine.values_per_s(t, dtype)
        read_time = 0.0
    else:
        read_time = machine.shared_exchange(local, read) - fence
    exchange = fences * fence + read_time + cross
    if activations:
        return exchange, exchange
    return exchange, fence + read_time + cross / buckets


def _data_comm(machine: Machine, layout: Layout, nbytes: float, shard: bool) -> tuple[float, float]:
    """(a step's gradient exchange, its last bucket's part): each bucket's collectives."""
    ranks = layout.local_ranks
    if layout.ranks <= 1:
        return 0.0, 0.0
    buckets = max(1, math.ceil(nbytes / BUCKET_BYTES))
    size = nbytes / buckets
    ops = ("reduce_scatter", "allgather") if shard else ("allreduce",)
    one = sum(machine.collective(op, ranks, size) for op in ops)
    one += network_allreduce(machine, layout.nodes, size)
    return buckets * one, one


def _stage_send(machine: Machine, layout: Layout, nbytes: float) -> float:
    """A send between neighbouring stages, the mean over ``R - 1`` boundaries, ``N - 1`` remote."""
    here = machine.collective("sendrecv", 2, nbytes)
    if layout.nodes <= 1:
        return here
    alpha, beta = machine.network_cost()
    crossing = layout.nodes - 1
    far = crossing * (alpha + beta * nbytes)
    return ((layout.ranks - 1 - crossing) * here + far) / (layout.ranks - 1)


def dense_pairs(work: ModelWork) -> list[tuple[LayerWork, LayerWork]]:
    """Tensor parallelism's (column-split, row-split) pairs of Dense layers, in order."""
    dense = [layer for layer in work.layers if "Dense" in layer.name]
    return list(zip(dense[0::2], dense[1::2], strict=False))


def tensor_allreduces(work: ModelWork, batch: int, itemsize: int) -> list[float]:
    """Bytes of each allreduce of a tensor-split step: each pair's output and input gradient."""
    out = []
    for column, row in dense_pairs(work):
        rows, _, width, _ = row.gemms[0].at(batch)
        out.append(rows * width * itemsize)
        if any(g.phase == DGRAD for g in column.gemms):
            rows, width, _, _ = column.gemms[0].at(batch)
            out.append(rows * width * itemsize)
    return out


def layer_times(
    machine: Machine, work: ModelWork, batch: int, threads: int, dtype: str, split: Any = None
) -> list[dict[str, float]]:
    """Each layer's phases for ``batch`` samples, cut into ``split(layer)`` parts (else whole)."""
    per_layer = []
    values = max(1, work.elementwise())
    for layer in work.layers:
        sub = ModelWork([layer], layer.params, work.input_shape, work.tokens_per_sample)
        share = layer.elementwise / values
        sub.rest = {t: s * share for t, s in work.rest.items()}
        sub.rest_per_step = {t: s * share for t, s in work.rest_per_step.items()}
        parts = split(layer) if split else 1
        per_layer.append(compute_times(machine, sub, batch, threads, dtype, parts))
    return per_layer


def _stage_times(
    machine: Machine, work: ModelWork, stages: int, micro: int, threads: int, dtype: str
) -> list[dict[str, float]]:
    """Each stage's phases for one micro-batch: ``stages`` contiguous runs of equal time."""
    per_layer = layer_times(machine, work, micro, threads, dtype)
    target = sum(sum(p.values()) for p in per_layer) / stages
    out: list[dict[str, float]] = []
    acc: dict[str, float] = {}
    for phases in per_layer:
        seconds, held = sum(phases.values()), sum(acc.values())
        if held and held + seconds / 2 > target and len(out) < stages - 1:
            out.append(acc)
            acc = {}
        for name, value in phases.items():
            acc[name] = acc.get(name, 0.0) + value
    out.append(acc)
    return out + [{}] * (stages - len(out))
