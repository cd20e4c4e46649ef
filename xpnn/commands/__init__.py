"""The command line: ``python -m xpnn``, its flags and subcommands; the planner's prediction."""

from xpnn.commands.plan import predict_run

__all__ = ["predict_run"]
