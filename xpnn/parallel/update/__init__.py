"""How a step's gradients become one update (``base.Update``); ``Plan.make_update`` picks it."""

from xpnn.parallel.update.base import DEFAULT_BUCKET_MB, Update, uses_byte_buckets

__all__ = ["DEFAULT_BUCKET_MB", "Update", "uses_byte_buckets"]
