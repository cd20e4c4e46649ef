"""Training: the ``Trainer`` loop and the callbacks that extend it."""
# isort: skip_file

from xpnn.train.callbacks import Callback, Checkpoints, EpochLog, FaultInjection, MetricsFile
from xpnn.train.callbacks import PhaseTimer, ProgressBar, SaveParameters
from xpnn.train.graph import Recorder
from xpnn.train.trace import Trace
from xpnn.train.trainer import RunFacts, TrainConfig, Trainer, TrainingDiverged, warmup_steps

__all__ = ["Callback", "Checkpoints", "EpochLog", "FaultInjection", "MetricsFile", "PhaseTimer"]
__all__ += ["ProgressBar", "Recorder", "RunFacts", "SaveParameters", "Trace", "TrainConfig"]
__all__ += ["Trainer", "TrainingDiverged", "warmup_steps"]
