"""Training over many ranks: ``comm`` (how ranks talk), ``update`` (how gradients become one
update), ``model`` (what a layout does to a model). Importing it imports neither mpi4py nor CuPy."""

from xpnn.parallel.plan import Plan

__all__ = ["Plan"]
