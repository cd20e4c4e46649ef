"""IDX reader (the MNIST file format), strict enough that a bad file is a one-line user error.

Format: two zero bytes, a type-code byte, a dimension-count byte, then one big-endian uint32 per
dimension, then the values in big-endian C order. Files are often gzip-compressed.
"""

from __future__ import annotations

import gzip
import math
import os
import zlib
from pathlib import Path

import numpy as np

from xpnn.errors import UserError

GZIP_MAGIC = b"\x1f\x8b"
MAX_NDIM = 4

# type code -> big-endian numpy dtype, as the IDX format defines them
TYPE_CODES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class IdxError(UserError):
    """A malformed IDX file; the message starts with the file's path and says what is wrong."""


def _fail(source: str, problem: str) -> IdxError:
    """Build the one-line error: path first, so the user knows which file to fix."""
    return IdxError(f"{source}: {problem}".replace("\n", " "))


def _hex(data: bytes) -> str:
    return data.hex(" ") if data else "nothing"


def _shape_str(dims: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in dims)


def parse_idx_header(data: bytes, source: str = "<bytes>") -> tuple[np.dtype, tuple[int, ...], int]:
    """Parse and validate an IDX header: (big-endian dtype, dims, header length in bytes).

    Only the header is examined, so this never fails for reasons other than ``IdxError``; the
    payload length is checked by ``read_idx``.
    """
    if len(data) == 0:
        raise _fail(source, "empty file")
    if len(data) < 4:
        raise _fail(source, f"truncated header: {len(data)} bytes, an IDX header needs at least 4")
    if data[0] != 0 or data[1] != 0:
        raise _fail(
            source,
            f"not an IDX file: wrong magic bytes {_hex(data[:4])} (expected 00 00 <type> <ndim>)",
        )
    code, ndim = data[2], data[3]
    if code not in TYPE_CODES:
        known = ", ".join(f"0x{c:02X}" for c in TYPE_CODES)
        raise _fail(source, f"unknown IDX type code 0x{code:02X} (known: {known})")
    if ndim == 0 or ndim > MAX_NDIM:
        raise _fail(source, f"unsupported number of dimensions {ndim} (expected 1 to {MAX_NDIM})")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise _fail(
            source,
            f"truncated header: {ndim} dimensions need {header_len} header bytes, "
            f"file has {len(data)}",
        )
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return TYPE_CODES[code], dims, header_len


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, gunzipped when it is gzip (by magic bytes) or named ``.gz``."""
    source = str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise _fail(source, "no such file") from None
    except OSError as exc:
        raise _fail(source, f"cannot read: {exc.strerror or exc}") from None
    if not raw:
        raise _fail(source, "empty file")
    is_gzip = raw[:2] == GZIP_MAGIC
    if path.suffix == ".gz" and not is_gzip:
        raise _fail(
            source,
            f"named .gz but not gzip-compressed (starts with {_hex(raw[:4])}); "
            "if it is an uncompressed IDX file, drop the .gz suffix",
        )
    if not is_gzip:
        return raw
    try:
        data = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as exc:
        raise _fail(source, f"corrupt gzip data: {exc}") from None
    if not data:
        raise _fail(source, "empty file (after gunzip)")
    return data


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (gzip or raw) into a writable native-endian array of the header's shape."""
    path = Path(path)
    source = str(path)
    data = _read_bytes(path)
    dtype, dims, header_len = parse_idx_header(data, source)
    expected = math.prod(dims) * dtype.itemsize
    actual = len(data) - header_len
    what = "" if dtype.itemsize == 1 else f" {dtype.newbyteorder('=').name} values"
    if actual < expected:
        raise _fail(
            source,
            f"truncated: header says {_shape_str(dims)}{what} = {expected} bytes of data, "
            f"file has {actual}",
        )
    if actual > expected:
        raise _fail(
            source,
            f"{actual - expected} bytes of trailing data: header says {_shape_str(dims)}{what} "
            f"= {expected} bytes of data, file has {actual}",
        )
    array = np.frombuffer(data, dtype=dtype, count=math.prod(dims), offset=header_len)
    return array.astype(dtype.newbyteorder("="), copy=True).reshape(dims)


def encode_idx(array: np.ndarray) -> bytes:
    """The IDX encoding of ``array`` (dtype one of TYPE_CODES' kinds, 1 to 4 dimensions)."""
    array = np.asarray(array)
    codes = {dt.newbyteorder("="): code for code, dt in TYPE_CODES.items()}
    code = codes.get(array.dtype.newbyteorder("="))
    if code is None or not 1 <= array.ndim <= MAX_NDIM:
        raise ValueError(f"IDX cannot hold a {array.ndim}-D {array.dtype} array")
    header = bytes([0, 0, code, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    return header + np.ascontiguousarray(array, dtype=TYPE_CODES[code]).tobytes()


def write_idx(path: str | os.PathLike, array: np.ndarray) -> Path:
    """Write ``array`` as an IDX file, gzip-compressed when the name ends in ``.gz``."""
    path = Path(path)
    data = encode_idx(array)
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return path


def read_idx_pair(
    images_path: str | os.PathLike, labels_path: str | os.PathLike, num_classes: int = 10
) -> tuple[np.ndarray, np.ndarray]:
    """Read matching image and label files: images (N, rows, cols) as stored, labels int64.

    Checks what a classifier needs: 3-D images, 1-D integer labels, equal counts, every label
    in ``[0, num_classes)``.
    """
    images = read_idx(images_path)
    if images.ndim != 3:
        raise _fail(
            str(images_path),
            f"expected 3-D images (count x rows x cols), header says {images.ndim}-D "
            f"{_shape_str(images.shape)}",
        )
    if 0 in images.shape:
        raise _fail(
            str(images_path),
            f"holds no pixels to learn from: header says {_shape_str(images.shape)}",
        )
    labels = read_idx(labels_path)
    if labels.ndim != 1:
        raise _fail(
            str(labels_path),
            f"expected 1-D labels, header says {labels.ndim}-D {_shape_str(labels.shape)}",
        )
    if labels.dtype.kind not in "iu":
        raise _fail(str(labels_path), f"labels must be integers, file holds {labels.dtype.name}")
    if len(labels) != len(images):
        raise _fail(
            str(labels_path),
            f"{len(labels)} labels but {images_path} has {len(images)} images",
        )
    labels = labels.astype(np.int64)
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if bad.size:
        i = int(bad[0])
        raise _fail(
            str(labels_path),
            f"label {labels[i]} at index {i} is outside [0, {num_classes}) "
            f"({bad.size} bad labels in all)",
        )
    return images, labels
