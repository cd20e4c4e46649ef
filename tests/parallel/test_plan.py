"""The plan: a run's layout built and checked once from the settings and the world, every
combination it refuses with its reason, and what it says in the header and the metrics."""

from types import SimpleNamespace

import numpy as np
import pytest

from xpnn.backends import get_backend
from xpnn.errors import UserError
from xpnn.nn import Dense, build_model
from xpnn.parallel.model.shared import param_layers
from xpnn.parallel.plan import Plan
from xpnn.parallel.update.node_shared import SharedBatchUpdate, SharedUpdate
from xpnn.run import RunSpec, resolve
from xpnn.train.optim import Schedule, make_optimizer


def world(size: int, rank: int = 0, local_size: int | None = None) -> SimpleNamespace:
    return SimpleNamespace(rank=rank, size=size, local_size=local_size or size)


def build(size: int, rank: int = 0, local_size: int | None = None, **settings) -> Plan:
    spec, _ = resolve(RunSpec(**settings))
    return Plan.build(spec, world(size, rank, local_size), threads=2)


def test_data_parallelism_is_one_replica_a_rank():
    plan = build(4)
    assert (plan.replicas, plan.model_ranks, plan.stages, plan.tensor_parts) == (4, 1, 1, 1)
    assert not plan.pipelined and not plan.spread
    assert (plan.place(3).replica, plan.place(3).index) == (3, 0)


@pytest.mark.parametrize(
    "size, settings, want",
    [
        (4, {"parallel": "tensor"}, (1, 4, 1, 4)),  # replicas, model ranks, stages, parts
        (4, {"parallel": "tensor", "model_ranks": 2}, (2, 2, 1, 2)),
        (4, {"parallel": "pipeline"}, (1, 4, 4, 1)),
        (8, {"parallel": "pipeline", "model_ranks": 4, "tensor_ranks": 2}, (2, 4, 2, 2)),
    ],
)
def test_the_grid_of_each_layout(size, settings, want):
    plan = build(size, **settings)
    assert (plan.replicas, plan.model_ranks, plan.stages, plan.tensor_parts) == want
    assert plan.replicas * plan.stages * plan.tensor_parts == size
    assert plan.spread and plan.pipelined == (settings["parallel"] == "pipeline")


def test_a_pipeline_plan_holds_its_schedule_and_the_nodes():
    plan = build(4, local_size=2, parallel="pipeline", microbatches=8, pipeline_schedule="1f1b")
    assert (plan.microbatches, plan.schedule, plan.recompute) == (8, "1f1b", False)
    assert (plan.nodes, plan.ranks_per_node) == (2, 2)
    assert build(4, microbatches=8).microbatches is None  # a data plan has none


@pytest.mark.parametrize(
    "size, settings, message",
    [
        (4, {"parallel": "tensor", "model_ranks": 3}, "`model_ranks` 3: 4 ranks do not split"),
        (2, {"parallel": "tensor", "model_ranks": 4}, "`model_ranks` 4: more than the job's 2"),
        (3, {"parallel": "pipeline", "tensor_ranks": 2}, "`tensor_ranks` 2: does not divide a"),
        (
            2,
            {"parallel": "tensor", "comm": "mpi-shm"},
            "`comm` mpi-shm: .* with `parallel` tensor use",
        ),
        (
            2,
            {"parallel": "pipeline", "comm": "mpi-shm"},
            "`comm` mpi-shm: .* `parallel` pipeline use",
        ),
    ],
)
def test_a_layout_that_does_not_fit_the_world_is_refused(size, settings, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        build(size, **settings)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"parallel": "tensor", "node_share": "activations"},
         "`node_share` activations: only with `parallel` data"),
        ({"parallel": "pipeline", "precision": "bf16"},
         "`precision` bf16: only with `parallel` data"),
        ({"precision": "fp16", "node_share": "activations"},
         "`precision` fp16: not with `node_share` activations"),
        ({"parallel": "tensor", "batch_threads": 2},
         "`batch_threads` 2: only with `parallel` data, not tensor"),
        ({"precision": "bf16", "batch_threads": 2},
         "`batch_threads` 2: only with `precision` fp32"),
        ({"batch_threads": 2, "node_share": "activations"},
         "`batch_threads` 2: not with `node_share` activations"),
        ({"parallel": "tensor", "grad_dtype": "float16"},
         "`grad_dtype` float16: only with `parallel` data"),
        ({"comm": "mpi-shm", "shard_optimizer": True}, "`shard_optimizer`: not with node-shared"),
        ({"precision": "bf16", "shard_optimizer": True}, "`shard_optimizer`: not with `precision`"),
        ({"grad_dtype": "bfloat16", "shard_optimizer": True},
         "`shard_optimizer`: not with `grad_dtype` bfloat16"),
        ({"cuda_graph": "on", "shard_optimizer": True}, "`shard_optimizer`: not with `cuda_graph`"),
    ],
)  # fmt: skip
def test_each_combination_is_refused_with_its_reason(settings, message):
    with pytest.raises(UserError, match=message) as caught:
        resolve(RunSpec(**settings))
    assert "\n" not in str(caught.value)


def test_the_header_names_the_grid_the_update_and_the_threads():
    plan = build(2).resolved("mpi-shm", "allreduce")
    assert plan.header() == "plan: 2 replicas x 1 stage x 1 part, allreduce over mpi-shm, 2 threads"
    piped = build(4, parallel="pipeline", model_ranks=2, microbatches=4, batch_threads=1)
    assert piped.resolved("mpi-host", "allreduce").header() == (
        "plan: 2 replicas x 2 stages x 1 part (gpipe, 4 micro-batches), allreduce over "
        "mpi-host, 2 threads"
    )
    threaded = build(1, batch_threads=2).resolved("self", "local")
    assert threaded.header() == (
        "plan: 1 replica x 1 stage x 1 part, local over self, 2 threads (2 batch threads)"
    )


def test_the_metrics_record_is_the_plans_fields_and_replicas():
    record = build(4, parallel="tensor", model_ranks=2).resolved("mpi-host", "allreduce").record()
    assert record["replicas"] == 2 and record["model_ranks"] == 2 and record["tensor_parts"] == 2
    assert record["mode"] == "tensor" and record["update"] == "allreduce"
    assert record["comm"] == "mpi-host" and record["shard_optimizer"] is False
    assert "microbatches" not in record  # None: not said


def test_a_batch_thread_plan_shares_gradients_not_activations():
    assert build(2).node_share == "auto"
    assert build(2, batch_threads=2).node_share == "gradients"


def test_a_run_records_and_prints_its_plan(tmp_path):
    from xpnn.run import run

    lines: list[str] = []
    done = run(
        RunSpec(dataset="synthetic", synthetic_size=64, epochs=1, hidden=(8,), progress=False),
        log=lines.append,
    )
    assert "xpnn: plan: 1 replica x 1 stage x 1 part, local over self" in "\n".join(lines)
    assert done["plan"]["replicas"] == 1 and done["plan"]["update"] == "local"


def test_apply_splits_or_stages_the_model_for_its_rank():
    from xpnn.backends import get_backend
    from xpnn.nn import build_model
    from xpnn.parallel.model.whole import whole_size

    backend = get_backend("numpy", "float64")
    whole = build_model("mlp", (8, 6)).build((5,), backend, 0)
    tensor = build(2, parallel="tensor")
    split = tensor.apply(build_model("mlp", (8, 6)), (5,), backend, 0, 1)
    assert tensor.part(1) == 1 and split.layers[1].lo == 4  # part 1 holds units [4:8]
    assert whole_size(split) == whole.size > split.size
    staged = build(2, parallel="pipeline").apply(build_model("mlp", (8, 6)), (5,), backend, 0, 1)
    assert (staged.index, staged.stages) == (1, 2) and whole_size(staged) == whole.size
    alone = build(1).apply(build_model("mlp", (8, 6)), (5,), backend, 0, 0)
    assert alone.size == whole.size and build(1).part(0) == 0


class NodeStandIn:
    """Local rank 0 of a node's two ranks, alone: its "shared" arrays are its own."""

    node_memory = True
    rank = local_rank = 0
    size = local_size = 2
    nodes = 1
    node = SimpleNamespace(allgather=lambda rank: [0, 1])

    def shared_zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def fence(self) -> None:
        pass


def _node_update(share: str):
    backend = get_backend("numpy", "float64")
    model = build_model("mlp", (16,)).build((8,), backend, 0)

    def optimizer(params, grads, parts=None, zeros=None):
        return make_optimizer("sgd", params, grads, backend.kernels, Schedule(0.1), parts, zeros)

    return (
        model,
        optimizer,
        Plan(node_share=share).make_update(model, NodeStandIn(), optimizer, 1, 4),
    )


@pytest.mark.parametrize("share", ["gradients", "activations"])
def test_the_plan_moves_the_model_into_node_memory_the_scheme_only_cuts_and_sums(share):
    """Applied over node memory, the plan gives the model its node's buffers (and, sharing
    activations, node-shared Dense twins); the update scheme built on that model moves
    nothing more."""
    whole = build_model("mlp", (16,)).build((8,), get_backend("numpy", "float64"), 0)
    model, optimizer, update = _node_update(share)
    assert update.name == f"shared {share}"
    np.testing.assert_array_equal(model.params, whole.params)  # local rank 0's values, moved
    kinds = {type(layer) for layer in param_layers(model)}
    assert (kinds == {Dense}) is (share == "gradients")
    params, grads, layers = model.params, model.grads, list(model.layers)
    if share == "gradients":
        again = SharedUpdate(model, NodeStandIn(), optimizer, np.zeros((2, model.size)))
    else:
        again = SharedBatchUpdate(model, NodeStandIn(), optimizer, update.place)
    assert again.name == update.name
    assert model.params is params and model.grads is grads and model.layers == layers
