"""How a step's gradients become one update (``base.Update``); ``Plan.make_update`` picks it."""

from typing import Any

from xpnn.parallel.update.base import DEFAULT_BUCKET_MB, Update


def uses_byte_buckets(comm: Any) -> bool:
    """Whether ``Plan.make_update`` cuts gradients into ``bucket_bytes`` buckets, not at layers."""
    return comm.size > 1 and not comm.node_memory


__all__ = ["DEFAULT_BUCKET_MB", "Update", "uses_byte_buckets"]
