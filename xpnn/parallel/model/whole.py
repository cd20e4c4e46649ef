"""The whole network from the ranks' pieces, named and ordered as one process has it: saved
files, checkpoints and the digest do not depend on the parallelism. What part a rank holds is
its strategy's to say (``share``); a core model holds all of it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from xpnn.nn.composite import Chain
from xpnn.nn.model import LayeredModel
from xpnn.parallel.model.tensor import SplitDense


@dataclass(frozen=True)
class Share:
    """The part of the network a rank's model holds, as the plan laid it out."""

    reads_input: bool = True  # forward reads the samples (a pipeline's later stages do not)
    scores: bool = True  # its loss is the network's (a pipeline's earlier stages have none)
    stages: int = 1  # pipeline stages the network is cut into (1: whole here, maybe split)
    whole_param_count: int | None = None  # the whole network's, where layers are elsewhere
    split_comm: Any = None  # the ranks holding its split layers' other slices (None: its comm)


WHOLE = Share()


def share(model: Any) -> Share:
    """What part of the network ``model`` holds: a strategy's wrapper says (a pipeline stage's
    ``share``); a core model, or one whose layers are split in place, the whole layer list."""
    return getattr(model, "share", WHOLE)


def leaf(layer: Any, name: str) -> tuple[Any, str]:
    """The layer that holds parameter ``name`` of ``layer`` (a composite's nested one), and
    the name it has there."""
    while isinstance(layer, Chain) and "." in name:
        child, _, name = name.partition(".")
        layer = layer.children[child]
    return layer, name


def whole_shape(layer: Any, name: str) -> tuple[int, ...]:
    """The shape of parameter ``name`` of ``layer`` in the whole network."""
    held, key = leaf(layer, name)
    if isinstance(held, SplitDense):
        return tuple(held.whole_shapes[key])
    return tuple(layer.initial[name][1])


def split_params(model: Any) -> dict[str, tuple[SplitDense, str]]:
    """Stable name -> (the split layer holding a slice of it, its name there): tensor
    parallelism's; none in a model without layers."""
    if not isinstance(model, LayeredModel):
        return {}
    out = {}
    for key, layer, name in model.param_names():
        held, own = leaf(layer, name)
        if isinstance(held, SplitDense) and own in held.split:
            out[key] = (held, own)
    return out


def whole_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """Stable name -> the parameter's shape in the whole network, for what this rank holds."""
    split = split_params(model)
    return {
        key: tuple(split[key][0].whole_shapes[split[key][1]] if key in split else view.shape)
        for key, view in model.named_views(model.params).items()
    }


def own_piece(model: Any, key: str, whole: np.ndarray) -> np.ndarray:
    """This rank's part of ``whole``, the whole parameter ``key`` of ``model``."""
    held = split_params(model).get(key)
    return whole if held is None else held[0].piece(held[1], whole)


def whole_arrays(model: Any, comm: Any, pieces: dict[str, Any]) -> dict[str, np.ndarray]:
    """``pieces`` (stable name -> this rank's part) made whole on every rank (collective)."""
    to_host = model.backend.to_host
    placed = share(model)
    split_comm = placed.split_comm or comm  # a stage's tensor parts
    split = split_params(model)
    out = {}
    for key in model.named_views(model.params):
        value = to_host(pieces[key])
        if key in split:
            axis = split[key][0].split[split[key][1]]
            value = np.concatenate(split_comm.allgather_obj(value), axis)
        out[key] = value
    if placed.stages > 1:  # each rank holds other layers: rank order is theirs
        merged: dict[str, np.ndarray] = {}
        for part in comm.allgather_obj(out):
            merged.update(part)
        out = merged
    return out


def whole_params(model: Any, comm: Any) -> dict[str, np.ndarray]:
    """Every parameter whole, under its stable name, on the host of every rank (collective)."""
    return whole_arrays(model, comm, model.named_views(model.params))


def replicated_ranges(model: Any, part: int) -> list[tuple[int, int]]:
    """[start, end) ranges of this rank's flat buffer holding parameters that another rank of
    its replica holds too (tensor parallelism's unsplit ones), counted there, not here: on
    every tensor part but the first (``part``, the plan's)."""
    if part == 0:
        return []
    split = split_params(model)
    out, offset = [], 0
    for key, view in model.named_views(model.params).items():
        size = math.prod(view.shape)
        if key not in split:
            out.append((offset, offset + size))
        offset += size
    return out


def is_spread(model: Any) -> bool:
    """Does this rank hold only part of the network (tensor or pipeline parallelism)?"""
    return whole_size(model) != model.size


def whole_size(model: Any) -> int:
    """How many parameters the network has, all ranks' pieces together."""
    count = share(model).whole_param_count  # a stage knows the layers it does not hold
    if count is not None:
        return count
    return sum(math.prod(shape) for shape in whole_shapes(model).values())
