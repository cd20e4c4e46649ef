"""What a run records and how it is read back: the named phases of a step that timers and
tracers listen to (``phases``), the digest ranks compare (``digest``), the traces merged into
one timeline and drawn (``timeline``, ``timeline_plot``), the training curves (``plot``), and
the one way xpnn writes a file, never through another user's link (``files``)."""

from xpnn.record import phases

__all__ = ["phases"]
