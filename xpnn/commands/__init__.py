"""Subcommands of ``python -m xpnn`` that read a run's flags: ``plan``, ``explain`` and
``calibrate`` (the planner's)."""
