"""Training over many ranks: ``comm``, ``update``, ``model``; imports neither mpi4py nor CuPy."""

from xpnn.parallel.plan import Plan

__all__ = ["Plan"]
