"""Training: the ``Trainer`` loop and the callbacks that extend it."""

from xpnn.train.callbacks import (
    Callback,
    Checkpoints,
    EpochLog,
    FaultInjection,
    MetricsFile,
    PhaseTimer,
    ProgressBar,
)
from xpnn.train.trainer import (
    TrainConfig,
    Trainer,
    TrainingDiverged,
    params_digest,
    peak_rss_mb,
    warmup_steps,
)

__all__ = [
    "Callback",
    "Checkpoints",
    "EpochLog",
    "FaultInjection",
    "MetricsFile",
    "PhaseTimer",
    "ProgressBar",
    "TrainConfig",
    "Trainer",
    "TrainingDiverged",
    "params_digest",
    "peak_rss_mb",
    "warmup_steps",
]
