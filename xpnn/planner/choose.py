"""The layouts a run could take on one machine, or on several nodes like it."""

from xpnn.planner.cost import Layout
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


def _splits(work: ModelWork | None, ranks: int, t: int, batch: int, nodes: int) -> list[Layout]:
    """Layouts of ``ranks`` ranks of ``t`` threads: data; with ``work``, tensor and pipeline."""
    divisors = [k for k in range(1, t + 1) if t % k == 0 and batch >= ranks * k]
    out = [Layout(ranks, t, "data", k, comm="auto", nodes=nodes) for k in divisors]
    if work is None or ranks == 1:
        return out
    if tensor_fits(work, ranks):
        out.append(Layout(ranks, t, "tensor", nodes=nodes))
    if sum(1 for layer in work.layers if layer.params) >= ranks:
        for m in (m for m in (ranks, 2 * ranks, 4 * ranks) if m <= batch):
            for schedule in ("gpipe", "1f1b"):
                out.append(Layout(ranks, t, "pipeline", 1, m, schedule, nodes=nodes))
    return out


def layouts(work: ModelWork, cores: int, max_ranks: int, batch: int) -> list[Layout]:
    """Every layout of up to ``max_ranks`` ranks on ``cores`` cores the planner can price."""
    out = []
    for r in (r for r in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64) if r <= max_ranks):
        for t in [t for t in range(1, cores // r + 1) if cores % (r * t) == 0] or [1]:
            out += _splits(work, r, t, batch, 1)
    return out


def node_layouts(
    cores: int, nodes: int, max_ranks: int, batch: int, work: ModelWork | None = None
) -> list[Layout]:
    """Every split of ``nodes`` nodes' ``cores`` into ranks, threads and batch threads."""
    fits = [r for r in range(1, min(cores, max_ranks) + 1) if cores % r == 0]
    return [x for r in fits for x in _splits(work, nodes * r, cores // r, batch, nodes)]
