"""Strategies that wrap or swap a model's layers when a run is built; layers know none of them.

- ``tensor``: ``split_layers`` swaps Dense pairs for column- and row-split twins;
- ``pipeline``: ``build_stage`` keeps a run of consecutive layers and streams micro-batches;
- ``shared``: ``share_layers`` swaps Dense layers for twins that share a node's activations;
- ``layout``: which ranks hold one replica and which split the batches (2-D parallelism);
- ``whole``: the whole network gathered from the pieces the ranks hold.
"""

from xpnn.parallel.model.layout import Groups, Place, make_groups, place_of, sub_world
from xpnn.parallel.model.pipeline import (
    DEFAULT_SCHEDULE,
    SCHEDULES,
    PipelineStage,
    build_stage,
    layer_costs,
    stage_bounds,
)
from xpnn.parallel.model.shared import SharedDense, UnitsDense, share_layers
from xpnn.parallel.model.tensor import ColumnDense, RowDense, split_layers
from xpnn.parallel.model.whole import (
    is_spread,
    own_piece,
    whole_arrays,
    whole_params,
    whole_shape,
    whole_size,
)

__all__ = [
    "DEFAULT_SCHEDULE",
    "SCHEDULES",
    "ColumnDense",
    "Groups",
    "PipelineStage",
    "Place",
    "RowDense",
    "SharedDense",
    "UnitsDense",
    "build_stage",
    "is_spread",
    "layer_costs",
    "make_groups",
    "own_piece",
    "place_of",
    "share_layers",
    "split_layers",
    "stage_bounds",
    "sub_world",
    "whole_arrays",
    "whole_params",
    "whole_shape",
    "whole_size",
]
