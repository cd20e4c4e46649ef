"""Subcommands of ``python -m xpnn`` that read a run's flags: ``plan``, ``explain`` and
``calibrate`` (the planner's)."""

from xpnn.commands.inputs import predict_run

__all__ = ["predict_run"]
