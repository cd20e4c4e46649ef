"""The layouts a run could take on one machine, and the one predicted fastest."""

from __future__ import annotations

from xpnn.planner.cost import Layout, Prediction, predict
from xpnn.planner.machine import Machine
from xpnn.planner.work import ModelWork


def tensor_fits(work: ModelWork, parts: int) -> bool:
    """Whether tensor parallelism's own split accepts the model over ``parts`` ranks."""
    from xpnn.errors import UserError
    from xpnn.parallel.model.tensor import split_layers

    try:
        split_layers(work.top_layers, 0, parts)
    except (UserError, ValueError):
        return False
    return bool(work.top_layers)


def layouts(work: ModelWork, cores: int, max_ranks: int, batch: int) -> list[Layout]:
    """Every layout of up to ``max_ranks`` ranks on ``cores`` cores the planner can price."""
    out = []
    ranks = [r for r in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64) if r <= max_ranks]
    blocks = sum(1 for layer in work.layers if layer.params)
    for r in ranks:
        threads = [t for t in range(1, cores // r + 1) if cores % (r * t) == 0] or [1]
        for t in threads:
            for k in (k for k in range(1, t + 1) if t % k == 0):
                if batch >= r * k:
                    out.append(Layout(r, t, "data", k, comm="auto"))
            if r == 1:
                continue
            if tensor_fits(work, r):
                out.append(Layout(r, t, "tensor"))
            if blocks >= r:
                for m in (r, 2 * r, 4 * r):
                    if m <= batch:
                        for schedule in ("gpipe", "1f1b"):
                            out.append(Layout(r, t, "pipeline", microbatches=m, schedule=schedule))
    return out


def node_layouts(
    cores: int, nodes: int, max_ranks: int, batch: int, work: ModelWork | None = None
) -> list[Layout]:
    """Layouts over ``nodes`` nodes of ``cores`` cores: every split of a node into ranks,
    threads and batch threads, repeated on each node, as data parallelism; with ``work``,
    tensor and pipeline parallelism over all the ranks too."""
    out = []
    for r in (r for r in range(1, min(cores, max_ranks) + 1) if cores % r == 0):
        t, ranks = cores // r, nodes * r
        for k in (k for k in range(1, t + 1) if t % k == 0):
            if batch >= ranks * k:
                out.append(Layout(ranks, t, "data", k, comm="auto", nodes=nodes))
        if work is None:
            continue
        if tensor_fits(work, ranks):
            out.append(Layout(ranks, t, "tensor", comm="mpi-host", nodes=nodes))
        if sum(1 for layer in work.layers if layer.params) >= ranks:
            for m in (m for m in (ranks, 2 * ranks, 4 * ranks) if m <= batch):
                for schedule in ("gpipe", "1f1b"):
                    out.append(Layout(ranks, t, "pipeline", 1, m, schedule, "mpi-host", nodes))
    return out


def fastest(
    machine: Machine,
    work: ModelWork,
    candidates: list[Layout],
    batch: int,
    optimizer: str,
    dtype: str,
) -> Prediction:
    """The candidate predicted fastest (the first of equals, so a choice does not flip)."""
    if not candidates:
        raise ValueError("no layout to choose from")
    found = [predict(machine, work, layout, batch, optimizer, dtype) for layout in candidates]
    return min(found, key=lambda p: p.step)
