"""Subcommands of ``python -m xpnn`` reading a run's flags: ``plan``, ``explain``, ``calibrate``."""

from xpnn.commands.plan import predict_run

__all__ = ["predict_run"]
