"""The whole network from the ranks' pieces, named and ordered as one process has it."""

import itertools
import math
from typing import Any

import numpy as np

from xpnn.nn.layer import Chain
from xpnn.nn.models import LayeredModel
from xpnn.parallel.model.tensor import SplitDense


class Portion:
    """What of the network a rank's model holds: all of it (these), or a stage's part."""

    reads_input: bool = True  # forward reads the samples (a pipeline's later stages do not)
    scores: bool = True  # its loss is the network's (a pipeline's earlier stages have none)
    whole_param_count: int | None = None  # the whole network's, where layers are elsewhere
    split_comm: Any = None  # the ranks holding its split layers' other slices (None: its comm)


def portion(model: Any) -> Portion:
    return model if isinstance(model, Portion) else Portion()


def split_of(layer: Any, name: str) -> tuple[SplitDense, str] | None:
    """The split layer (maybe a composite's child) holding ``layer``'s ``name``, and its name."""
    while isinstance(layer, Chain) and "." in name:
        child, _, name = name.partition(".")
        layer = layer.children[child]
    return (layer, name) if isinstance(layer, SplitDense) and name in layer.split else None


def whole_shape(layer: Any, name: str) -> tuple[int, ...]:
    held = split_of(layer, name)
    return tuple(held[0].whole_shapes[held[1]] if held else layer.initial[name][1])


def split_params(model: Any) -> dict[str, tuple[SplitDense, str]]:
    """Stable name -> ``split_of`` its parameter, for those split."""
    names = model.param_names() if isinstance(model, LayeredModel) else []
    return {key: held for key, layer, name in names if (held := split_of(layer, name))}


def whole_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Stable name -> the parameter's shape in the whole network, for what this rank holds."""
    split = {key: held.whole_shapes[own] for key, (held, own) in split_params(model).items()}
    return {k: tuple(split.get(k, v.shape)) for k, v in model.named_views(model.params).items()}


def own_piece(model: Any, key: str, whole: np.ndarray) -> np.ndarray:
    held = split_params(model).get(key)
    return whole if held is None else held[0].piece(held[1], whole)


def whole_arrays(model: Any, comm: Any, pieces: dict[str, Any]) -> dict[str, np.ndarray]:
    """``pieces`` (stable name -> this rank's part) made whole on every rank (collective)."""
    placed = portion(model)
    out = {key: model.backend.to_host(piece) for key, piece in pieces.items()}
    parts = placed.split_comm or comm  # a stage's tensor parts, or a replica
    for key, (held, own) in split_params(model).items():
        out[key] = np.concatenate(parts.allgather_obj(out[key]), held.split[own])
    if placed.whole_param_count is not None:  # ranks hold other layers: rank order is theirs
        out = {key: value for part in comm.allgather_obj(out) for key, value in part.items()}
    return out


def whole_params(model: Any, comm: Any) -> dict[str, np.ndarray]:
    """Every parameter whole, under its stable name, on the host of every rank (collective)."""
    return whole_arrays(model, comm, model.named_views(model.params))


def replicated_ranges(model: Any, part: int) -> list[tuple[int, int]]:
    """[start, end) of this rank's flat buffer whose (unsplit) parameters part 0 counts."""
    if part == 0:
        return []
    split, views = split_params(model), model.named_views(model.params)
    sizes = [math.prod(view.shape) for view in views.values()]
    ranges = zip(views, sizes, itertools.accumulate(sizes), strict=True)
    return [(end - n, end) for key, n, end in ranges if key not in split]


def is_spread(model: Any) -> bool:
    return whole_size(model) != model.size


def whole_size(model: Any) -> int:
    count = portion(model).whole_param_count
    return count or sum(math.prod(shape) for shape in whole_shapes(model).values())
