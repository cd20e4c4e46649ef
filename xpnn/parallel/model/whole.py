"""The whole network from the ranks' pieces, named and ordered as one process has it: saved
files, checkpoints and the digest do not depend on the parallelism."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def whole_arrays(model: Any, comm: Any, pieces: dict[str, Any]) -> dict[str, np.ndarray]:
    """``pieces`` (stable name -> this rank's part) made whole on every rank (collective)."""
    to_host = model.backend.to_host
    split_comm = model.split_comm or comm  # a stage's tensor parts
    out = {}
    for key, layer, name in model.param_names():
        value = to_host(pieces[key])
        axis = layer.split.get(name)
        out[key] = value if axis is None else np.concatenate(split_comm.allgather_obj(value), axis)
    if model.stages > 1:  # each rank holds other layers: rank order is theirs
        merged: dict[str, np.ndarray] = {}
        for part in comm.allgather_obj(out):
            merged.update(part)
        out = merged
    return out


def whole_params(model: Any, comm: Any) -> dict[str, np.ndarray]:
    """Every parameter whole, under its stable name, on the host of every rank (collective)."""
    return whole_arrays(model, comm, model.named_params())


def whole_shape(layer: Any, name: str) -> tuple[int, ...]:
    """The shape of parameter ``name`` of ``layer`` in the whole network."""
    return tuple(layer.whole_shape(name))


def own_piece(layer: Any, name: str, whole: np.ndarray) -> np.ndarray:
    """This rank's part of ``whole``, laid out as parameter ``name`` of ``layer``."""
    return layer.piece(name, whole)


def replicated_ranges(model: Any) -> list[tuple[int, int]]:
    """[start, end) ranges of this rank's flat buffer holding parameters that another rank of
    its replica holds too (tensor parallelism's unsplit ones), counted there, not here: on
    every part but the first (``model.part``, which the plan sets where it splits layers)."""
    part = model.part
    if part == 0:
        return []
    out, offset = [], 0
    for _, layer, name in model.param_names():
        size = math.prod(layer.params[name].shape)
        if name not in layer.split:
            out.append((offset, offset + size))
        offset += size
    return out


def is_spread(model: Any) -> bool:
    """Does this rank hold only part of the network (tensor or pipeline parallelism)?"""
    return whole_size(model) != model.size


def whole_size(model: Any) -> int:
    """How many parameters the network has, all ranks' pieces together."""
    if model.whole_param_count is not None:  # a stage knows the layers it does not hold
        return model.whole_param_count
    return sum(math.prod(whole_shape(layer, name)) for _, layer, name in model.param_names())
