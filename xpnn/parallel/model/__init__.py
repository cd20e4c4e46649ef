"""What a layout does to a model when a run is built (layers know none of it)."""

from xpnn.parallel.model.batch_threads import BatchThreads
from xpnn.parallel.model.shared import share_layers

__all__ = ["BatchThreads", "share_layers"]
