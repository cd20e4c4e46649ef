"""What a layout does to a model when a run is built (layers know none of it)."""

from xpnn.parallel.model.batch_threads import BatchThreads

__all__ = ["BatchThreads"]
