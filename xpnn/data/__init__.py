"""Data: IDX files, datasets (mnist, fashion-mnist, synthetic, text), downloads, sharding."""

from xpnn.data.datasets import Dataset, epoch_order, find_files, global_batches, load_dataset, shard
from xpnn.data.download import default_cache_dir, fetch
from xpnn.data.idx import IdxError, parse_idx_header, read_idx, read_idx_pair, write_idx
from xpnn.data.text import shakespeare_path

__all__ = ["Dataset", "IdxError", "default_cache_dir", "epoch_order", "fetch", "find_files"]
__all__ += ["global_batches", "load_dataset", "parse_idx_header", "read_idx", "read_idx_pair"]
__all__ += ["shakespeare_path", "shard", "write_idx"]
