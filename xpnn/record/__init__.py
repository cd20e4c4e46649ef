"""What a run records and how it is read back: a step's phases, the ranks' digest, the merged
timeline and its drawing, the training curves, and xpnn's one safe way to write a file."""

from xpnn.record import phases

__all__ = ["phases"]
