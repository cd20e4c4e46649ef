"""Loading data that tries to break it: files larger than their headers, gzip bombs, named
pipes, another dataset's files, ranks that read other data, endless downloads, odd homes."""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
import threading
import time
import tracemalloc
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, assert_one_line_user_error, mpiexec_path, run_xpnn
from test_datasets import offline  # noqa: F401 - autouse: an empty cache, no network
from test_download import dead_url
from test_idx import NAMES, small_arrays, write_mnist_dir

from xpnn.data import IdxError, load_dataset, read_idx
from xpnn.data import download as dl
from xpnn.data.download import default_cache_dir, fetch
from xpnn.errors import UserError

HEADER_100 = b"\x00\x00\x08\x03" + (100).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2


def peak_bytes(fn) -> tuple[BaseException | None, int]:
    """What ``fn()`` raised and the most memory Python held while it ran."""
    tracemalloc.start()
    try:
        fn()
        raised = None
    except Exception as exc:
        raised = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return raised, peak


# --- files whose size disagrees with their header -----------------------------------------------


def test_raw_file_longer_than_its_header_is_refused_without_reading_it(tmp_path: Path) -> None:
    """A 6 GiB sparse file behind a 100x28x28 header took 42 s and 6 GiB of memory to be
    called "trailing data" (under a memory limit: "the data set does not fit in memory ()",
    naming no file). Now its size is compared with the header before the payload is read."""
    path = tmp_path / "train-images-idx3-ubyte"
    with open(path, "wb") as f:
        f.write(HEADER_100)
        f.truncate(256 << 20)  # sparse: no disk used
    raised, peak = peak_bytes(lambda: read_idx(path))
    assert isinstance(raised, IdxError)
    assert str(raised) == (
        f"{path}: {(256 << 20) - 16 - 78400} bytes of trailing data: header says 100x28x28 = "
        f"78400 bytes of data, file has {(256 << 20) - 16}"
    )
    assert peak < 8 << 20, peak


def test_gzip_bomb_is_refused_without_inflating_it(tmp_path: Path) -> None:
    """gzip.decompress() held the whole inflated file: 3 GiB of zeros in a 3 MB .gz took 25 s
    and 3 GiB. Now only the header's bytes and a bounded look past them are inflated."""
    path = tmp_path / "train-images-idx3-ubyte.gz"
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip framing
    with open(path, "wb") as f:
        f.write(packer.compress(HEADER_100 + bytes(78400)))
        for _ in range(64):
            f.write(packer.compress(bytes(1 << 20)))
        f.write(packer.flush())
    raised, peak = peak_bytes(lambda: read_idx(path))
    assert isinstance(raised, IdxError)
    assert str(raised).startswith(f"{path}: at least ")
    assert "bytes of trailing data: header says 100x28x28 = 78400 bytes of data" in str(raised)
    assert peak < 40 << 20, peak


def test_named_pipe_is_refused_at_once(tmp_path: Path) -> None:
    """read_idx on a named pipe waited for a writer forever (here one comes after 3 s, so
    that the old behaviour fails the test instead of hanging it: "empty file")."""
    fifo = tmp_path / "train-labels-idx1-ubyte"
    os.mkfifo(fifo)
    done = threading.Event()

    def late_writer() -> None:
        deadline = time.monotonic() + 3
        while not done.wait(0.05) and time.monotonic() < deadline + 2:
            if time.monotonic() < deadline:
                continue
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                return
            except OSError:  # no reader (yet)
                pass

    writer = threading.Thread(target=late_writer, daemon=True)
    writer.start()
    start = time.monotonic()
    try:
        with pytest.raises(IdxError) as info:
            read_idx(fifo)
    finally:
        done.set()
        writer.join()
    assert str(info.value) == f"{fifo}: cannot read: a named pipe, not a file"
    assert time.monotonic() - start < 1


def test_gzip_compressed_twice_says_so(tmp_path: Path) -> None:
    """It said "not an IDX file: wrong magic bytes 1f 8b 08 00"."""
    path = tmp_path / "t10k-labels-idx1-ubyte.gz"
    path.write_bytes(gzip.compress(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x01\x07")))
    with pytest.raises(IdxError) as info:
        read_idx(path)
    assert str(info.value) == f"{path}: gzip-compressed twice: gunzip it once to get the IDX file"


def test_valid_files_still_read_the_same(tmp_path: Path) -> None:
    """The streaming reader against the arrays written, gzip and raw, every IDX type."""
    rng = np.random.default_rng(1)
    for dtype in ("u1", "i1", "i2", "i4", "f4", "f8"):
        array = (rng.standard_normal((3, 5, 7)) * 100).astype(dtype)
        for name in ("a.gz", "a"):
            from xpnn.data import write_idx

            got = read_idx(write_idx(tmp_path / f"{dtype}{name}", array))
            assert got.dtype == array.dtype.newbyteorder("=") and got.flags.writeable
            np.testing.assert_array_equal(got, array)


# --- another dataset's files in a --data-dir ----------------------------------------------------


def linked_dir(directory: Path, source: Path, mapping: dict[str, str]) -> Path:
    """A --data-dir of symbolic links: name in it -> name in ``source``."""
    directory.mkdir()
    for name, target in mapping.items():
        (directory / name).symlink_to(source / target)
    return directory


def test_fashion_files_for_dataset_mnist_are_refused(fashion_dir: Path, tmp_path: Path) -> None:
    """--dataset mnist --data-dir <Fashion-MNIST> trained on Fashion-MNIST, called "mnist"."""
    same = {n: n for n in NAMES.values()}
    directory = linked_dir(tmp_path / "d", fashion_dir, same)
    with pytest.raises(UserError) as info:
        load_dataset("mnist", data_dir=directory)
    path = directory / "train-images-idx3-ubyte.gz"
    assert str(info.value) == (
        f"{path}: this is Fashion-MNIST's train-images-idx3-ubyte.gz, not MNIST's "
        "train-images-idx3-ubyte.gz (by its SHA-256); use `dataset` fashion-mnist"
    )


def test_train_and_test_files_swapped_are_refused(fashion_dir: Path, tmp_path: Path) -> None:
    """Swapped files would train on the 10,000 test samples and test on the 60,000 training ones."""
    other = {"train": "t10k", "t10k": "train"}
    swap = {n: other[n.split("-")[0]] + n[n.index("-") :] for n in NAMES.values()}
    directory = linked_dir(tmp_path / "d", fashion_dir, swap)
    with pytest.raises(UserError, match="this is Fashion-MNIST's t10k-images-idx3-ubyte.gz, not"):
        load_dataset("fashion-mnist", data_dir=directory)


def test_cli_other_datasets_files_is_one_line_exit_2(fashion_dir: Path, tmp_path: Path) -> None:
    proc = run_xpnn(
        ["--dataset", "mnist", "--data-dir", str(fashion_dir), "--epochs", "1", "--no-progress"],
        env={"XPNN_DATA_HOME": str(tmp_path / "cache"), "XPNN_MNIST_MIRRORS": dead_url()},
        timeout=60,
    )
    assert_one_line_user_error(proc, "this is Fashion-MNIST's train-images-idx3-ubyte.gz")


def test_own_files_are_not_mistaken_for_known_ones(tmp_path: Path) -> None:
    data = load_dataset("fashion-mnist", data_dir=write_mnist_dir(tmp_path / "d"))
    assert data.n_train == 100


# --- ranks that read other data -----------------------------------------------------------------


def mpmd(first: list[str], second: list[str]) -> list[str]:
    """``mpiexec -n 1 python -m xpnn FIRST : -n 1 python -m xpnn SECOND``."""
    python = [sys.executable, "-m", "xpnn"]
    return [mpiexec_path(), "-n", "1", *python, *first, ":", "-n", "1", *python, *second]


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (small_arrays(1, 130, 50), "(130 train / 50 test samples, rank 0 100 / 50; rank 1 from"),
        (small_arrays(1), "(the same number of samples but other values; rank 1 from"),
        (small_arrays(0), None),  # a copy of the same files: trains
    ],
)
def test_ranks_that_read_other_data_stop(tmp_path: Path, other, message: str | None) -> None:
    """--data-dir may differ between ranks (each node's own copy). Copies of other sizes hung
    the job forever (one rank ran more batches); of the same size they trained each rank on
    other samples without a word."""
    mine, theirs = write_mnist_dir(tmp_path / "a"), write_mnist_dir(tmp_path / "b", other)
    args = ["--dataset", "mnist", "--epochs", "1", "--hidden", "8", "--batch-size", "64"]
    args += ["--no-progress", "--threads", "1"]
    env = {**os.environ, "XPNN_DATA_HOME": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        mpmd([*args, "--data-dir", str(mine)], [*args, "--data-dir", str(theirs)]),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    if message is None:
        assert proc.returncode == 0, proc.stderr
        return
    assert_one_line_user_error(proc, "xpnn: --data-dir: rank 1 read other data than rank 0 ")
    assert message in proc.stderr
    assert f"--data-dir {theirs}, rank 0 from --data-dir {mine}); every rank" in proc.stderr


# --- the download cache's location --------------------------------------------------------------


def test_empty_home_does_not_put_the_cache_at_the_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """HOME= made Path.home() '/', and the cache /.cache/xpnn, created there."""
    import pwd

    monkeypatch.delenv("XPNN_DATA_HOME")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", "")
    own = pwd.getpwuid(os.getuid()).pw_dir
    assert default_cache_dir() == Path(own) / ".cache" / "xpnn"

    def nobody(uid: int):
        raise KeyError(uid)

    monkeypatch.setattr(pwd, "getpwuid", nobody)  # a uid without an entry (docker run -u)
    with pytest.raises(UserError, match=r"^no download cache: \$HOME is not set .* XPNN_DATA_HOME"):
        default_cache_dir()


def test_data_home_of_an_unknown_user_is_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """XPNN_DATA_HOME=~nosuchuser/x: "xpnn: RuntimeError: Could not determine home directory.",
    exit 1."""
    monkeypatch.setenv("XPNN_DATA_HOME", "~xpnn_no_such_user/cache")
    with pytest.raises(UserError) as info:
        default_cache_dir()
    assert str(info.value) == (
        "XPNN_DATA_HOME=~xpnn_no_such_user/cache: cannot expand ~: no home for xpnn_no_such_user"
    )


def test_relative_xdg_cache_home_is_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the XDG Base Directory specification asks (it made the cache depend on the cwd)."""
    monkeypatch.delenv("XPNN_DATA_HOME")
    monkeypatch.setenv("HOME", "/home/someone")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert default_cache_dir() == Path("/home/someone/.cache/xpnn")


def test_cache_directory_that_is_a_file_says_so(tmp_path: Path) -> None:
    """It said "...: cannot use as download cache: File exists"."""
    cache = tmp_path / "cache"  # the offline fixture's XPNN_DATA_HOME
    cache.mkdir()
    (cache / "mnist").write_text("not a directory")
    with pytest.raises(UserError) as info:
        load_dataset("mnist")
    assert str(info.value) == (
        f"{cache / 'mnist'}: cannot use as download cache: {cache / 'mnist'} is not a directory"
    )


# --- downloads that never end -------------------------------------------------------------------


class _Flood(BaseHTTPRequestHandler):
    """Sends 8 MiB of zeros (announcing 1 TiB for paths with 'announce'), then hangs up."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.send_response(200)
        if "announce" in self.path:
            self.send_header("Content-Length", str(1 << 40))
        self.end_headers()
        try:
            for _ in range(8):
                self.wfile.write(bytes(1 << 20))
        except OSError:  # the client gave up
            pass
        self.close_connection = True

    def log_message(self, format: str, *args) -> None:
        pass


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("x.gz", r"sent over [12],\d{3},\d{3} bytes, more than the 1 MiB any file may have"),
        ("announce.gz", r"announced 1,099,511,627,776 bytes, more than the 1 MiB any file may"),
    ],
)
def test_a_download_larger_than_any_file_is_cut_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, why: str
) -> None:
    """A mirror that streamed without end filled the cache's disk (16 GB in a minute here)."""
    monkeypatch.setattr(dl, "MAX_DOWNLOAD_BYTES", 1 << 20)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Flood)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        with pytest.raises(UserError) as info:
            fetch(name, "0" * 64, [url], tmp_path / "c", timeout=5)
    finally:
        server.shutdown()
        server.server_close()
    assert re.search(re.escape(f"{url}{name}: ") + why, str(info.value)), info.value
    assert list((tmp_path / "c").iterdir()) == []


# --- --data-dir slips ---------------------------------------------------------------------------


def test_dangling_symlink_in_data_dir_says_so(tmp_path: Path) -> None:
    """It said "missing t10k-labels-idx1-ubyte.gz (or t10k-labels-idx1-ubyte)"."""
    directory = write_mnist_dir(tmp_path / "d")
    link = directory / "t10k-labels-idx1-ubyte.gz"
    link.unlink()
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(UserError) as info:
        load_dataset("mnist", data_dir=directory)
    assert str(info.value) == (
        f"`data_dir` {directory}: missing t10k-labels-idx1-ubyte.gz (a symbolic link to "
        f"{tmp_path / 'gone'}, which does not exist)"
    )


def test_tilde_left_by_the_shell_is_pointed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """--data-dir=~/data: the shell expands no ~ after '='."""
    monkeypatch.setenv("HOME", "/home/someone")
    with pytest.raises(UserError) as info:
        load_dataset("mnist", data_dir="~/xpnn-no-such-data")
    assert str(info.value) == (
        "`data_dir` ~/xpnn-no-such-data: no such directory (the shell left its ~ as it is: did "
        "you mean /home/someone/xpnn-no-such-data?)"
    )
