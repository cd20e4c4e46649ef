"""A run's whole layout in one frozen object (torchtitan's ``ParallelDims``), checked once."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from xpnn.errors import UserError
from xpnn.nn.sequential import Sequential
from xpnn.parallel.comm import MpiHostCommunicator, make_communicator
from xpnn.parallel.comm.base import Communicator, SelfCommunicator
from xpnn.parallel.model import shared
from xpnn.parallel.model.pipeline import build_stage
from xpnn.parallel.model.tensor import split_layers
from xpnn.parallel.update import base, node_shared, sharded

MODES = ("data", "tensor", "pipeline")  # how the ranks share the work (``--parallel``)
NODE_SHARES = ("auto", "gradients", "activations")  # mpi-shm: what a node's ranks share


@dataclass(frozen=True)
class Place:
    model_ranks: int  # ranks that hold one replica between them (1 under data parallelism)
    replicas: int  # replicas of the network: the ranks that split each batch
    index: int  # this rank's place within its replica: its slice or its stage
    replica: int  # which replica this rank belongs to: its share of each batch


@dataclass
class Groups:
    """The communicators of one rank: its whole job, its replica and its data-parallel peers."""

    world: Communicator  # every rank: barriers, the parameter digest, a pipeline's metrics
    model: Communicator  # this rank's replica: split layers and pipeline stages talk here
    data: Communicator  # the same place in every replica: they split batches, sum gradients
    fallback_reason: str | None = dataclasses.field(init=False)  # the model's and data's, once
    auto_fallback: str | None = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        for kind in ("fallback_reason", "auto_fallback"):
            reasons = [getattr(c, kind, None) for c in (self.model, self.data)]
            setattr(self, kind, "; ".join(r for r in dict.fromkeys(reasons) if r) or None)

    @classmethod
    def of(cls, comm: Communicator, spread: bool = False) -> Groups:
        # the 1-D layouts: ``comm`` is the data group, or (``spread``) the model group
        alone = SelfCommunicator()
        return cls(comm, comm, alone) if spread else cls(comm, alone, comm)

    @property
    def name(self) -> str:
        if isinstance(self.data, SelfCommunicator):
            return self.model.name
        if isinstance(self.model, SelfCommunicator):
            return self.data.name
        return f"{self.model.name} (model) + {self.data.name} (data)"


@dataclass(frozen=True)
class Plan:
    """Every degree of a run: ``ranks`` = ``replicas`` x ``stages`` x ``tensor_parts``."""

    mode: str = "data"  # --parallel: data, tensor, pipeline
    ranks: int = 1
    model_ranks: int = 1  # ranks holding one replica between them
    tensor_parts: int = 1  # ranks splitting each layer that declares a split
    stages: int = 1  # pipeline stages a replica
    microbatches: int | None = None  # a pipeline's, as its stage settles them
    schedule: str | None = None  # a pipeline's: gpipe, 1f1b
    recompute: bool = False
    batch_threads: int = 1  # threads each running a twin of the model on a part of the batch
    threads: int | None = None  # BLAS/Numba threads a rank
    comm: str = "auto"  # the transport asked for; the live one once ``resolved``
    node_share: str = "auto"  # mpi-shm: what a node's ranks share (gradients, activations)
    shard_optimizer: bool = False  # ZeRO stage 1: each data-parallel rank its shard of the state
    update: str | None = None  # the update scheme, once built (``resolved``)
    nodes: int = 1
    ranks_per_node: int = 1

    @property
    def replicas(self) -> int:  # the ranks that split each batch
        return self.ranks // self.model_ranks

    @property
    def pipelined(self) -> bool:
        return self.mode == "pipeline"

    @property
    def spread(self) -> bool:  # a replica's ranks split the network
        return self.mode != "data"

    @classmethod
    def build(cls, spec: Any, world: Any, threads: int | None = None) -> Plan:
        """The plan of ``spec`` (a resolved ``RunSpec``) on ``world``, or a refusal naming it."""
        model_ranks = 1 if spec.parallel == "data" else (spec.model_ranks or world.size)
        if model_ranks > world.size:
            why = f"more than the job's {world.size} rank(s)"
            raise UserError(f"`model_ranks` {model_ranks}: {why}")
        if world.size % model_ranks:
            why = f"{world.size} ranks do not split into replicas of {model_ranks} ranks"
            raise UserError(f"`model_ranks` {model_ranks}: {why}; give a divisor of {world.size}")
        parts = model_ranks if spec.parallel == "tensor" else (spec.tensor_ranks or 1)
        pipelined = spec.parallel == "pipeline"
        if pipelined and model_ranks % parts:
            why = f"does not divide a replica's {model_ranks} ranks into pipeline stages"
            raise UserError(f"`tensor_ranks` {parts}: {why}")
        if spec.comm == "mpi-shm" and 1 < model_ranks == world.size:  # no replicas to share
            raise UserError(
                "`comm` mpi-shm: shares one copy of the parameters between data-parallel ranks; "
                f"with `parallel` {spec.parallel} use mpi-host or auto, or `model_ranks` K "
                "below the rank count for data-parallel replicas"
            )
        # shared activations hold a rank's whole part of a batch, not a batch thread's
        share = spec.node_share or "auto"
        share = "gradients" if spec.batch_threads > 1 and share == "auto" else share
        per_node = max(1, min(world.local_size, world.size))
        return cls(
            mode=spec.parallel,
            ranks=world.size,
            model_ranks=model_ranks,
            tensor_parts=parts,
            stages=model_ranks // parts if pipelined else 1,
            microbatches=spec.microbatches if pipelined else None,
            schedule=spec.pipeline_schedule if pipelined else None,
            recompute=bool(spec.recompute) if pipelined else False,
            batch_threads=spec.batch_threads,
            threads=threads,
            comm=spec.comm,
            node_share=share,
            shard_optimizer=spec.shard_optimizer,
            nodes=-(-world.size // per_node),
            ranks_per_node=per_node,
        )

    def place(self, rank: int) -> Place:
        # a replica's ranks are consecutive
        k = self.model_ranks
        return Place(k, self.replicas, rank % k, rank // k)

    def apply(
        self, model: Any, shape: tuple[int, ...], backend: Any, seed: int, rank: int, name: Any = ""
    ) -> Any:
        """``model`` (named ``name``) split, staged and built for rank ``rank``."""
        index, parts, part = self.place(rank).index, self.tensor_parts, self.part(rank)
        if self.spread and not isinstance(model, Sequential):
            what = f"`model` {name} is not an xpnn.nn.Sequential of layers to split or stage"
            raise UserError(f"`parallel` {self.mode}: {what}; use `parallel` data")
        if self.pipelined and parts > 1:
            if not any(inner.tensor_pairs for top in model.layers for inner in top.walk()):
                # an MLP's pairs are top-level layers, which a stage boundary could separate
                raise UserError(
                    f"`tensor_ranks` {parts}: `model` {name} declares no splits inside "
                    "its layers (`model` gpt does); use `parallel` tensor"
                )
        if parts > 1:
            model.layers = split_layers(model.layers, part, parts)
        if not self.pipelined:
            model.build(shape, backend, seed)
            return model
        stage = (index // parts, self.stages, self.microbatches, self.schedule, self.recompute)
        return build_stage(model, shape, backend, seed, *stage, tensor=(part, parts))

    def part(self, rank: int) -> int:
        """Stage s part p is its replica's rank s * parts + p."""
        return self.place(rank).index % self.tensor_parts

    def settled(self, stage: Any) -> Plan:
        """The plan as a pipeline stage settled its micro-batches."""
        if not self.pipelined:
            return self
        settled = ("microbatches", "schedule", "recompute")
        return dataclasses.replace(self, **{k: getattr(stage, k) for k in settled})

    def groups(self, world: Any, backend: Any) -> Groups:
        """This rank's communicators (collective); a sharded optimizer's without node memory."""
        kind, place = self.comm, self.place(world.rank)
        if self.shard_optimizer and kind == "auto" and not getattr(backend, "is_gpu", False):
            kind = "mpi-host" if self.ranks > 1 else kind
        if self.model_ranks == 1:  # data parallelism, or replicas of one rank each
            return Groups.of(make_communicator(world, backend, kind))
        if self.replicas == 1:
            return Groups.of(make_communicator(world, backend, kind, shares_params=False), True)
        split = "auto" if kind == "mpi-shm" else kind  # a replica shares no parameters
        model = make_communicator(world.split(place.replica), backend, split, shares_params=False)
        data = make_communicator(world.split(place.index), backend, kind)
        everyone = MpiHostCommunicator(world.mpi_comm)  # host-side metrics and agreement only
        return Groups(everyone, model, data)

    def stage_comm(self, world: Any, backend: Any) -> Any:
        """The communicator of this rank's pipeline stage's tensor parts (collective)."""
        place = self.place(world.rank)
        sub = world.split(place.replica * self.stages + place.index // self.tensor_parts)
        kind = "auto" if self.comm == "mpi-shm" else self.comm
        return make_communicator(sub, backend, kind, shares_params=False)

    def make_update(
        self,
        model: Any,
        comm: Any,
        make_optimizer: Any,
        bucket_bytes: int,
        batch_size: int,
        deferred: bool = False,
        accumulate: int = 1,
        wire: Any = None,
    ) -> Any:
        """The update scheme over the data-parallel ``comm``, node memory shared first."""
        if comm.size == 1:
            return base.LocalUpdate(model, comm, make_optimizer, deferred)
        if self.shard_optimizer:
            return sharded.ShardedUpdate(model, comm, make_optimizer, bucket_bytes, deferred)
        if not comm.node_memory:
            return base.AllreduceUpdate(model, comm, make_optimizer, bucket_bytes, deferred, wire)
        if accumulate > 1 and self.node_share == "activations":
            why = "not with `accumulate` above 1 (the ranks share one batch's activations)"
            raise UserError(f"`node_share` activations: {why}; use `node_share` gradients")
        if accumulate == 1 and node_shared.shares_activations(model, batch_size, self.node_share):
            place = shared.share_activations(model, comm, batch_size)
            return node_shared.SharedBatchUpdate(model, comm, make_optimizer, place, deferred, wire)
        rows = shared.share_gradients(model, comm)
        return node_shared.SharedUpdate(model, comm, make_optimizer, rows, deferred, wire)

    def resolved(self, transport: str, update: str) -> Plan:
        """The plan as built: the live transport and the update scheme."""
        return dataclasses.replace(self, comm=transport, update=update)

    def header(self) -> str:
        def n(count: int, word: str) -> str:
            return f"{count} {word}{'' if count == 1 else 'es' if word[-1] == 'h' else 's'}"

        grid = f"{n(self.replicas, 'replica')} x {n(self.stages, 'stage')}"
        grid += f" x {n(self.tensor_parts, 'part')}"
        if self.pipelined:
            grid += f" ({self.schedule}, {n(self.microbatches or 0, 'micro-batch')})"
        threads = n(self.threads or 1, "thread")
        if self.batch_threads > 1:
            threads += f" ({self.batch_threads} batch threads)"
        return f"plan: {grid}, {self.update or 'update'} over {self.comm}, {threads}"

    def record(self) -> dict[str, Any]:
        """A metrics line's ``plan``."""
        said = dataclasses.asdict(self)
        return {"replicas": self.replicas, **{k: v for k, v in said.items() if v is not None}}


def check(spec: Any) -> None:
    """The combinations of ``spec`` no layout supports, each refused with its reason."""
    mode, k, precision, share = spec.parallel, spec.batch_threads, spec.precision, spec.node_share
    only_data = f"only with `parallel` data (this run has `parallel` {mode}"
    refusals = {
        f"`node_share` activations: {only_data}, whose ranks split the network)": (
            share == "activations" and mode != "data"
        ),
        f"`precision` {precision}: {only_data})": precision != "fp32" and mode != "data",
        f"`precision` {precision}: not with `node_share` activations; use `node_share` gradients": (
            precision != "fp32" and share == "activations"
        ),
        f"`batch_threads` {k}: only with `parallel` data, not {mode}": k > 1 and mode != "data",
        f"`batch_threads` {k}: only with `precision` fp32 (the {precision} passes run on one "
        "low-precision copy of the model)": k > 1 and precision != "fp32",
        f"`batch_threads` {k}: not with `node_share` activations (the node's ranks would share "
        "one batch's activations, not a thread's part)": k > 1 and share == "activations",
        f"`grad_dtype` {spec.grad_dtype}: {only_data})": (
            spec.grad_dtype is not None and mode != "data"
        ),
    }
    if spec.shard_optimizer:
        fp32_only = "(fp32 updates only)"
        refusals |= {
            "`shard_optimizer`: not with node-shared memory (`comm` mpi-shm, `node_share`), whose "
            "ranks already keep one copy of the parameters and state a node": (
                spec.comm == "mpi-shm" or share is not None
            ),
            f"`shard_optimizer`: not with `precision` {precision} {fp32_only}": precision != "fp32",
            f"`shard_optimizer`: not with `grad_dtype` {spec.grad_dtype} {fp32_only}": (
                spec.grad_dtype is not None
            ),
            "`shard_optimizer`: not with `cuda_graph` on (its gather is on the host)": (
                spec.cuda_graph == "on"
            ),
        }
    for message, refused in refusals.items():
        if refused:
            raise UserError(message)
