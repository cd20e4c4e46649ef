"""Training over many ranks: ``comm`` (how ranks talk), ``update`` (how gradients become one
update) and ``model`` (strategies that wrap or swap layers); the process itself is
``xpnn.runtime``. Importing it imports neither mpi4py nor CuPy."""

from xpnn.parallel.plan import Plan

__all__ = ["Plan"]
