"""What a layout does to a model when a run is built (layers know none of it)."""

from xpnn.parallel.model.batch_threads import BatchThreads
from xpnn.parallel.model.layout import make_groups
from xpnn.parallel.model.pipeline import build_stage, layer_costs, stage_bounds
from xpnn.parallel.model.shared import share_layers
from xpnn.parallel.model.tensor import split_layers
from xpnn.parallel.model.whole import whole_params, whole_size

__all__ = ["BatchThreads", "build_stage", "layer_costs", "make_groups", "share_layers"]
__all__ += ["split_layers", "stage_bounds", "whole_params", "whole_size"]
