"""IDX reader: round trips, every kind of malformed file, header fuzzing, and the CLI's handling."""

from __future__ import annotations

import gzip
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import run_xpnn
from hypothesis import given, settings
from hypothesis import strategies as st

from xpnn.data import IdxError, parse_idx_header, read_idx, read_idx_pair, write_idx
from xpnn.data.idx import TYPE_CODES, encode_idx
from xpnn.errors import UserError

NAMES = {
    "train_images": "train-images-idx3-ubyte.gz",
    "train_labels": "train-labels-idx1-ubyte.gz",
    "test_images": "t10k-images-idx3-ubyte.gz",
    "test_labels": "t10k-labels-idx1-ubyte.gz",
}


def small_arrays(seed: int = 0, n_train: int = 100, n_test: int = 50) -> dict[str, np.ndarray]:
    """Valid MNIST-shaped contents: uint8 28x28 images, uint8 labels 0..9."""
    rng = np.random.default_rng(seed)
    return {
        "train_images": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        "train_labels": rng.integers(0, 10, n_train, dtype=np.uint8),
        "test_images": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        "test_labels": rng.integers(0, 10, n_test, dtype=np.uint8),
    }


def write_mnist_dir(directory: Path, arrays: dict[str, np.ndarray] | None = None) -> Path:
    """A --data-dir holding the four standard gzip files."""
    directory.mkdir(parents=True, exist_ok=True)
    for role, array in (arrays or small_arrays()).items():
        write_idx(directory / NAMES[role], array)
    return directory


def assert_one_line(exc: BaseException, path: Path | str) -> str:
    """The error contract: one line, starting with the offending file's path."""
    message = str(exc)
    assert "\n" not in message
    assert message.startswith(f"{path}: "), message
    return message


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["u1", "i1", "i2", "i4", "f4", "f8"])
@pytest.mark.parametrize("suffix", [".idx", ".gz"])
def test_round_trip_every_type(tmp_path: Path, dtype: str, suffix: str) -> None:
    rng = np.random.default_rng(1)
    array = (rng.standard_normal((3, 4, 5)) * 100).astype(dtype)
    out = read_idx(write_idx(tmp_path / f"a{suffix}", array))
    assert out.dtype == np.dtype(dtype).newbyteorder("=")
    assert out.flags.writeable
    np.testing.assert_array_equal(out, array)


@pytest.mark.parametrize("shape", [(7,), (2, 3), (2, 3, 4), (1, 2, 3, 4), (0, 28, 28)])
def test_round_trip_every_rank(tmp_path: Path, shape: tuple[int, ...]) -> None:
    array = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    np.testing.assert_array_equal(read_idx(write_idx(tmp_path / "a.idx", array)), array)


def test_gzip_detected_by_magic_without_suffix(tmp_path: Path) -> None:
    array = np.arange(10, dtype=np.uint8)
    path = tmp_path / "labels-idx1-ubyte"
    path.write_bytes(gzip.compress(encode_idx(array)))
    np.testing.assert_array_equal(read_idx(path), array)


def test_header_is_big_endian() -> None:
    data = bytes([0, 0, 0x0B, 2, 0, 0, 0, 2, 0, 0, 1, 0]) + b"\x00" * 1024
    dtype, dims, header_len = parse_idx_header(data)
    assert dtype == np.dtype(">i2") and dims == (2, 256) and header_len == 12


def test_pair_returns_int64_labels(tmp_path: Path) -> None:
    d = write_mnist_dir(tmp_path)
    images, labels = read_idx_pair(d / NAMES["train_images"], d / NAMES["train_labels"])
    assert images.shape == (100, 28, 28) and images.dtype == np.uint8
    assert labels.shape == (100,) and labels.dtype == np.int64


# --- faults, shared by the unit tests and the CLI tests -----------------------------------------
# Each fault replaces one of the four files of a valid --data-dir: (role, bytes to write).


def _raw(role: str, arrays: dict[str, np.ndarray]) -> bytes:
    return encode_idx(arrays[role])


def _truncated(a):  # 1000 bytes of pixel data instead of 100 * 784
    return "train_images", gzip.compress(_raw("train_images", a)[: 16 + 1000])


def _trailing(a):
    return "test_images", gzip.compress(_raw("test_images", a) + b"\x00" * 5)


def _wrong_magic(a):
    return "test_images", gzip.compress(b"\x01\x02" + _raw("test_images", a)[2:])


def _not_gzip(a):  # an uncompressed file under the .gz name
    return "train_labels", _raw("train_labels", a)


def _corrupt_gzip(a):
    data = gzip.compress(_raw("train_images", a))
    return "train_images", data[: len(data) // 2]


def _empty(a):
    return "test_labels", b""


def _unknown_type(a):
    data = _raw("train_labels", a)
    return "train_labels", gzip.compress(data[:2] + b"\x0a" + data[3:])


def _ndim_zero(a):
    return "train_labels", gzip.compress(b"\x00\x00\x08\x00")


def _ndim_five(a):
    return "train_images", gzip.compress(b"\x00\x00\x08\x05" + b"\x00\x00\x00\x01" * 5 + b"\x07")


def _truncated_header(a):
    return "train_images", gzip.compress(_raw("train_images", a)[:10])


def _count_mismatch(a):  # 99 labels for 100 images
    return "train_labels", gzip.compress(encode_idx(a["train_labels"][:99]))


def _label_out_of_range(a):
    labels = a["test_labels"].copy()
    labels[7] = 10
    return "test_labels", gzip.compress(encode_idx(labels))


def _images_2d(a):
    return "train_images", gzip.compress(encode_idx(a["train_images"].reshape(100, 784)))


def _labels_2d(a):
    return "test_labels", gzip.compress(encode_idx(a["test_labels"].reshape(25, 2)))


FAULTS: dict[str, tuple[Callable, str]] = {
    # name: (builder, text the message must contain)
    "truncated": (
        _truncated,
        "truncated: header says 100x28x28 = 78400 bytes of data, file has 1000",
    ),
    "trailing data": (_trailing, "5 bytes of trailing data"),
    "wrong magic": (_wrong_magic, "wrong magic bytes 01 02 08 03"),
    "not gzip": (_not_gzip, "named .gz but not gzip-compressed"),
    "corrupt gzip": (_corrupt_gzip, "corrupt gzip data"),
    "empty": (_empty, "empty file"),
    "unknown type": (_unknown_type, "unknown IDX type code 0x0A"),
    "ndim 0": (_ndim_zero, "unsupported number of dimensions 0"),
    "ndim 5": (_ndim_five, "unsupported number of dimensions 5"),
    "truncated header": (_truncated_header, "truncated header: 3 dimensions need 16"),
    "count mismatch": (_count_mismatch, "99 labels but"),
    "label out of range": (_label_out_of_range, "label 10 at index 7 is outside [0, 10)"),
    "images not 3-D": (_images_2d, "expected 3-D images"),
    "labels not 1-D": (_labels_2d, "expected 1-D labels"),
}


def faulty_dir(tmp_path: Path, fault: str) -> tuple[Path, Path]:
    """A data dir with one bad file; returns (dir, path of the bad file)."""
    arrays = small_arrays()
    directory = write_mnist_dir(tmp_path / "data", arrays)
    role, data = FAULTS[fault][0](arrays)
    bad = directory / NAMES[role]
    bad.write_bytes(data)
    return directory, bad


@pytest.mark.parametrize("fault", FAULTS)
def test_fault_raises_idx_error_naming_file(tmp_path: Path, fault: str) -> None:
    directory, bad = faulty_dir(tmp_path, fault)
    split = "train" if bad.name.startswith("train") else "t10k"
    images = directory / f"{split}-images-idx{3}-ubyte.gz"
    labels = directory / f"{split}-labels-idx1-ubyte.gz"
    with pytest.raises(IdxError) as info:
        read_idx_pair(images, labels)
    assert isinstance(info.value, UserError)
    assert FAULTS[fault][1] in assert_one_line(info.value, bad)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(IdxError) as info:
        read_idx(tmp_path / "nope.gz")
    assert "no such file" in assert_one_line(info.value, tmp_path / "nope.gz")


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(IdxError) as info:
        read_idx(tmp_path)  # a directory where a file should be
    assert "cannot read" in assert_one_line(info.value, tmp_path)


def test_write_refuses_what_idx_cannot_hold(tmp_path: Path) -> None:
    for array in (np.zeros(3, np.int64), np.zeros(())):  # no IDX type code; 0-D
        with pytest.raises(ValueError, match="IDX cannot hold"):
            write_idx(tmp_path / "x", array)


def test_float_labels_rejected(tmp_path: Path) -> None:
    images = write_idx(tmp_path / "i.gz", np.zeros((3, 2, 2), np.uint8))
    labels = write_idx(tmp_path / "l.gz", np.zeros(3, np.float32))
    with pytest.raises(IdxError) as info:
        read_idx_pair(images, labels)
    assert "labels must be integers" in assert_one_line(info.value, labels)


def test_num_classes_respected(tmp_path: Path) -> None:
    images = write_idx(tmp_path / "i.gz", np.zeros((3, 2, 2), np.uint8))
    labels = write_idx(tmp_path / "l.gz", np.array([0, 1, 2], np.uint8))
    read_idx_pair(images, labels, num_classes=3)
    with pytest.raises(IdxError, match=r"label 2 at index 2 is outside \[0, 2\)"):
        read_idx_pair(images, labels, num_classes=2)


# --- fuzzing: parse_idx_header raises IdxError or returns, nothing else -------------------------


def _check_parse(data: bytes) -> None:
    try:
        dtype, dims, header_len = parse_idx_header(data, "fuzz")
    except IdxError as exc:
        assert_one_line(exc, "fuzz")
    else:
        assert 1 <= len(dims) <= 4 and header_len == 4 + 4 * len(dims) <= len(data)
        assert dtype in TYPE_CODES.values() and all(d >= 0 for d in dims)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40))
def test_fuzz_random_bytes(data: bytes) -> None:
    _check_parse(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40))
def test_fuzz_random_bytes_after_magic(data: bytes) -> None:
    _check_parse(b"\x00\x00" + data)


@st.composite
def mutated_headers(draw: st.DrawFn) -> bytes:
    """A valid header plus a little data, then byte flips and possibly a truncation."""
    code = draw(st.sampled_from(sorted(TYPE_CODES)))
    dims = draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=4))
    data = bytearray([0, 0, code, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims)
    data += draw(st.binary(max_size=8))
    for _ in range(draw(st.integers(0, 3))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))])


@settings(max_examples=300, deadline=None)
@given(mutated_headers())
def test_fuzz_mutated_headers(data: bytes) -> None:
    _check_parse(data)


@settings(max_examples=60, deadline=None)
@given(mutated_headers(), st.booleans(), st.booleans())
def test_fuzz_read_idx_files(data: bytes, compress: bool, gz_name: bool) -> None:
    """Whole files too: a mangled file, gzipped or not, only ever raises IdxError."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / ("f.gz" if gz_name else "f.idx")
        path.write_bytes(gzip.compress(data) if compress else data)
        try:
            read_idx(path)
        except IdxError as exc:
            assert_one_line(exc, path)


# --- the real CLI: a bad file is one stderr line and exit code 2 --------------------------------

CLI_FAULTS = [
    "truncated",
    "wrong magic",
    "not gzip",
    "empty",
    "count mismatch",
    "label out of range",
]


@pytest.mark.parametrize("fault", CLI_FAULTS)
def test_cli_bad_file_is_one_line_exit_2(tmp_path: Path, fault: str) -> None:
    directory, bad = faulty_dir(tmp_path, fault)
    args = ["--dataset", "mnist", "--data-dir", str(directory), "--epochs", "1"]
    args += ["--model", "mlp", "--hidden", "8", "--batch-size", "64", "--backend", "numpy"]
    dead = "http://127.0.0.1:9/"  # never reach the network, even if the data dir were ignored
    env = {"XPNN_DATA_HOME": str(tmp_path / "cache"), "XPNN_MNIST_MIRRORS": dead}
    proc = run_xpnn(args, env=env, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert str(bad) in lines[0]
