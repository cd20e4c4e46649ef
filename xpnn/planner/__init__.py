"""The planner: this machine measured (``machine``), a model's step (``work``), layouts' costs."""

from xpnn.planner.cost import Layout, Prediction, predict
from xpnn.planner.machine import Machine, cached, calibrate, load
from xpnn.planner.work import ModelWork, model_work

__all__ = ["Layout", "Machine", "ModelWork", "Prediction", "cached", "calibrate", "load"]
__all__ += ["model_work", "predict"]
