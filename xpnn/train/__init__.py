"""Training: the ``Trainer`` loop and the callbacks that extend it."""
# isort: skip_file

from xpnn.train.callbacks import Callback, Checkpoints, EpochLog, FaultInjection
from xpnn.train.callbacks import MetricsFile, PhaseTimer, ProgressBar, SaveParameters
from xpnn.train.trainer import RunFacts, TrainConfig, Trainer, TrainingDiverged
from xpnn.train.trainer import warmup_steps

__all__ = ["Callback", "Checkpoints", "EpochLog", "FaultInjection", "MetricsFile", "PhaseTimer"]
__all__ += ["ProgressBar", "TrainConfig", "Trainer", "TrainingDiverged"]
__all__ += ["RunFacts", "SaveParameters", "warmup_steps"]
from xpnn.train.trace import Trace  # noqa: E402 -- after the callbacks it extends

__all__ += ["Trace"]
from xpnn.train.graph import Recorder  # noqa: E402 -- the trainer's replayed step records

__all__ += ["Recorder"]
