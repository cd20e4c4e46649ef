"""The planner: this machine measured (``machine``), a model's step (``work``), layouts' costs."""

from xpnn.planner.cost import Layout
from xpnn.planner.machine import Machine, cached, load

__all__ = ["Layout", "Machine", "cached", "load"]
