"""Training: the ``Trainer`` loop and the callbacks that extend it."""
# isort: skip_file

from xpnn.train.callbacks import Callback, Checkpoints, EpochLog, FaultInjection  # noqa: F401
from xpnn.train.callbacks import MetricsFile, PhaseTimer, ProgressBar  # noqa: F401
from xpnn.train.trainer import TrainConfig, Trainer, TrainingDiverged  # noqa: F401
from xpnn.train.trainer import params_digest, peak_rss_mb, warmup_steps  # noqa: F401
