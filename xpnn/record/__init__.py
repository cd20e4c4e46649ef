"""What a run records and reads back: phases, digests, timelines, curves; and safe writes."""

from xpnn.record import phases

__all__ = ["phases"]
