"""Subcommands of ``python -m xpnn`` reading a run's flags: ``plan``, ``explain``, ``calibrate``."""

from xpnn.commands.inputs import predict_run

__all__ = ["predict_run"]
