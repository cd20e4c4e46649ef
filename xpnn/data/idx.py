"""IDX files (MNIST's format, often gzipped); a bad file is a one-line error."""

import gzip
import io
import math
import os
import zlib
from pathlib import Path

import numpy as np

from xpnn.data.files import NotAFile, open_regular
from xpnn.errors import UserError

GZIP_MAGIC = b"\x1f\x8b"
MAX_NDIM = 4
CHUNK = 1 << 22  # what is read (and, gzip, decompressed) at a time
TRAILING_COUNTED = 1 << 24  # trailing bytes read and counted up to this many

TYPE_CODES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


class IdxError(UserError):
    """A malformed IDX file; the message starts with the file's path."""


def _fail(source: str | os.PathLike, problem: str) -> IdxError:
    return IdxError(f"{source}: {problem}".replace("\n", " "))


def _shape_str(dims: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in dims)


def parse_idx_header(data: bytes, source: str = "<bytes>") -> tuple[np.dtype, tuple[int, ...], int]:
    """(big-endian dtype, dims, header length) of a valid IDX header, else an ``IdxError``."""
    if len(data) == 0:
        raise _fail(source, "empty file")
    if len(data) < 4:
        raise _fail(source, f"truncated header: {len(data)} bytes, an IDX header needs at least 4")
    if data[0] != 0 or data[1] != 0:
        got = f"wrong magic bytes {data[:4].hex(' ')}"
        raise _fail(source, f"not an IDX file: {got} (expected 00 00 <type> <ndim>)")
    code, ndim = data[2], data[3]
    if code not in TYPE_CODES:
        known = ", ".join(f"0x{c:02X}" for c in TYPE_CODES)
        raise _fail(source, f"unknown IDX type code 0x{code:02X} (known: {known})")
    if ndim == 0 or ndim > MAX_NDIM:
        raise _fail(source, f"unsupported number of dimensions {ndim} (expected 1 to {MAX_NDIM})")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        need = f"{ndim} dimensions need {header_len} header bytes"
        raise _fail(source, f"truncated header: {need}, file has {len(data)}")
    dims = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    return TYPE_CODES[code], dims, header_len


def _read_growing(stream: io.BufferedIOBase, n: int) -> bytearray:
    """Up to ``n`` bytes, the buffer growing with what arrives, not to what a header claims."""
    out = bytearray()
    while len(out) < n and (chunk := stream.read(min(CHUNK, n - len(out)))):
        out += chunk
    return out


def _check_payload(
    source: str, dims: tuple[int, ...], dtype: np.dtype, actual: int, more: bool = False
) -> None:
    expected = math.prod(dims) * dtype.itemsize
    what = "" if dtype.itemsize == 1 else f" {dtype.newbyteorder('=').name} values"
    says = f"header says {_shape_str(dims)}{what} = {expected} bytes of data"
    at_least = "at least " if more else ""
    if actual < expected:
        raise _fail(source, f"truncated: {says}, file has {actual}")
    if actual > expected:
        extra = f"{at_least}{actual - expected} bytes of trailing data"
        raise _fail(source, f"{extra}: {says}, file has {at_least}{actual}")


def _header_and_payload(
    stream: io.BufferedIOBase, source: str, size: int | None
) -> tuple[np.dtype, tuple[int, ...], bytearray]:
    """(dtype, dims, payload), gzip inflated only as far as the header says: never a gzip bomb."""
    head = _read_growing(stream, 4 + 4 * MAX_NDIM)
    if not head:
        raise _fail(source, "empty file (after gunzip)")
    if size is None and bytes(head[:2]) == GZIP_MAGIC:
        raise _fail(source, "gzip-compressed twice: gunzip it once to get the IDX file")
    dtype, dims, header_len = parse_idx_header(bytes(head), source)
    expected = math.prod(dims) * dtype.itemsize
    payload = head[header_len:]
    if size is not None:
        _check_payload(source, dims, dtype, size - header_len)
    try:
        if len(payload) < expected:  # read at once only what the file's size says is there
            more = expected - len(payload)
            payload += _read_growing(stream, more) if size is None else stream.read(more)
    except MemoryError:
        raise MemoryError(f"{source}: {_shape_str(dims)} values, {expected:,} bytes") from None
    rest = len(_read_growing(stream, TRAILING_COUNTED))  # none left after a short payload
    _check_payload(source, dims, dtype, len(payload) + rest, rest == TRAILING_COUNTED)
    return dtype, dims, payload


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """An IDX file (gzip, by its magic bytes, or raw) as a writable native-endian array."""
    path = Path(path)
    source = str(path)
    try:
        fd, info = open_regular(path)
        with open(fd, "rb", buffering=CHUNK) as raw:
            magic = raw.read(4)
            if not magic:
                raise _fail(source, "empty file")
            is_gzip = magic[:2] == GZIP_MAGIC
            if path.suffix == ".gz" and not is_gzip:
                raise _fail(
                    source,
                    f"named .gz but not gzip-compressed (starts with {magic.hex(' ')}); "
                    "if it is an uncompressed IDX file, drop the .gz suffix",
                )
            raw.seek(0)
            if is_gzip:
                with gzip.GzipFile(fileobj=raw, mode="rb") as stream:
                    try:
                        dtype, dims, payload = _header_and_payload(stream, source, None)
                    except (OSError, EOFError, zlib.error) as exc:
                        raise _fail(source, f"corrupt gzip data: {exc}") from None
            else:  # /proc and some network file systems report 0 bytes: then read and count
                dtype, dims, payload = _header_and_payload(raw, source, info.st_size or None)
    except FileNotFoundError:
        raise _fail(source, "no such file") from None
    except NotAFile as exc:
        raise _fail(source, f"cannot read: {exc}, not a file") from None
    except OSError as exc:  # the disk failed mid-read, too
        raise _fail(source, f"cannot read: {exc.strerror or exc}") from None
    array = np.frombuffer(payload, dtype=dtype, count=math.prod(dims))
    return array.astype(dtype.newbyteorder("="), copy=False).reshape(dims)  # writable


def encode_idx(array: np.ndarray) -> bytes:
    array = np.asarray(array)
    codes = {dt.newbyteorder("="): code for code, dt in TYPE_CODES.items()}
    code = codes.get(array.dtype.newbyteorder("="))
    if code is None or not 1 <= array.ndim <= MAX_NDIM:
        raise ValueError(f"IDX cannot hold a {array.ndim}-D {array.dtype} array")
    dims = b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    values = np.ascontiguousarray(array, dtype=TYPE_CODES[code]).tobytes()
    return bytes([0, 0, code, array.ndim]) + dims + values


def write_idx(path: str | os.PathLike, array: np.ndarray) -> Path:
    """Write ``array`` as an IDX file, gzip-compressed when the name ends in ``.gz``."""
    path = Path(path)
    data = encode_idx(array)
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)
    return path


def read_idx_pair(
    images_path: str | os.PathLike, labels_path: str | os.PathLike, num_classes: int = 10
) -> tuple[np.ndarray, np.ndarray]:
    """Matching image and label files: images (N, rows, cols) as stored, int64 labels in range."""
    images = read_idx(images_path)
    shape = _shape_str(images.shape)
    if images.ndim != 3:
        says = f"header says {images.ndim}-D {shape}"
        raise _fail(images_path, f"expected 3-D images (count x rows x cols), {says}")
    if 0 in images.shape:
        raise _fail(images_path, f"holds no pixels to learn from: header says {shape}")
    labels = read_idx(labels_path)
    if labels.ndim != 1:
        says = f"header says {labels.ndim}-D {_shape_str(labels.shape)}"
        raise _fail(labels_path, f"expected 1-D labels, {says}")
    if labels.dtype.kind not in "iu":
        raise _fail(labels_path, f"labels must be integers, file holds {labels.dtype.name}")
    if len(labels) != len(images):
        raise _fail(labels_path, f"{len(labels)} labels but {images_path} has {len(images)} images")
    labels = labels.astype(np.int64)
    bad = np.flatnonzero((labels < 0) | (labels >= num_classes))
    if bad.size:
        i = int(bad[0])
        where = f"label {labels[i]} at index {i} is outside [0, {num_classes})"
        raise _fail(labels_path, f"{where} ({bad.size} bad labels in all)")
    return images, labels
