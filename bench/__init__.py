"""xpnn's benchmark suite: ``python -m bench LIST | NAME [flags] | report [--quick]``."""
