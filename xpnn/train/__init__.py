"""Training: the ``Trainer`` loop and the callbacks that extend it."""
# isort: skip_file

from xpnn.train.callbacks import Callback, Checkpoints, EpochLog, FaultInjection
from xpnn.train.callbacks import MetricsFile, PhaseTimer, ProgressBar
from xpnn.train.trainer import TrainConfig, Trainer, TrainingDiverged
from xpnn.train.trainer import peak_rss_mb, warmup_steps

__all__ = ["Callback", "Checkpoints", "EpochLog", "FaultInjection", "MetricsFile", "PhaseTimer"]
__all__ += ["ProgressBar", "TrainConfig", "Trainer", "TrainingDiverged", "peak_rss_mb"]
__all__ += ["warmup_steps"]
from xpnn.train.trace import Trace  # noqa: E402 -- after the callbacks it extends

__all__ += ["Trace"]
