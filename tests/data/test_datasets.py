"""Dataset registry: where files are found, what comes back, synthetic data, replication."""

from __future__ import annotations

import dataclasses
import gzip
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from conftest import run_xpnn, train_and_load
from test_download import Server, dead_url
from test_idx import NAMES, small_arrays, write_mnist_dir

from xpnn.data import Dataset, IdxError, load_dataset, write_idx
from xpnn.data import datasets as ds
from xpnn.data.download import sha256_file
from xpnn.errors import UserError


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Every test gets an empty cache and mirrors that refuse: nothing can reach the internet."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("XPNN_DATA_HOME", str(cache))
    monkeypatch.setenv("XPNN_MNIST_MIRRORS", dead_url())
    monkeypatch.setenv("XPNN_FASHION_MNIST_MIRRORS", dead_url())
    return cache


def check_image_dataset(data: Dataset, n_train: int, n_test: int) -> None:
    assert data.x_train.shape == (n_train, 1, 28, 28) and data.x_test.shape == (n_test, 1, 28, 28)
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10
    for x, y in ((data.x_train, data.y_train), (data.x_test, data.y_test)):
        assert x.dtype == np.float32 and y.dtype == np.int64
        assert x.min() >= 0.0 and x.max() <= 1.0
        assert y.min() >= 0 and y.max() < 10


def expected_x(images: np.ndarray) -> np.ndarray:
    return (images.astype(np.float32) / 255)[:, None]


# --- real Fashion-MNIST -------------------------------------------------------------------------


def test_fashion_mnist_real_data(fashion_dir: Path) -> None:
    data = load_dataset("fashion-mnist")  # found in the system directory, no --data-dir
    check_image_dataset(data, 60000, 10000)
    assert data.name == "fashion-mnist"
    assert data.x_train.min() == 0.0 and data.x_train.max() == 1.0
    assert set(np.unique(data.y_train)) == set(range(10)) == set(np.unique(data.y_test))


def test_fashion_mnist_lookup_order(fashion_dir: Path, tmp_path: Path) -> None:
    """The system copy is used without --data-dir; --data-dir wins when given."""
    found = ds.find_files("fashion-mnist", None, download=False)
    assert found["train_images"] == fashion_dir / "train-images-idx3-ubyte.gz"
    mine = write_mnist_dir(tmp_path / "mine")
    assert ds.find_files("fashion-mnist", mine, download=False)["test_labels"].parent == mine


def test_fashion_mnist_hash_table_matches_debian_files(fashion_dir: Path) -> None:
    for filename, sha in ds.SHA256["fashion-mnist"].items():
        assert sha256_file(fashion_dir / filename) == sha, filename


# --- --data-dir ---------------------------------------------------------------------------------


def test_data_dir_gzip_files(tmp_path: Path) -> None:
    """Small files whose hashes are not in the table: structure is all that is checked."""
    arrays = small_arrays()
    data = load_dataset("mnist", data_dir=write_mnist_dir(tmp_path / "d", arrays))
    check_image_dataset(data, 100, 50)
    np.testing.assert_array_equal(data.x_train, expected_x(arrays["train_images"]))
    np.testing.assert_array_equal(data.y_test, arrays["test_labels"])


def test_data_dir_uncompressed_files(tmp_path: Path) -> None:
    arrays = small_arrays(seed=3)
    for role, array in arrays.items():
        write_idx(tmp_path / NAMES[role].removesuffix(".gz"), array)
    data = load_dataset("fashion-mnist", data_dir=tmp_path)
    np.testing.assert_array_equal(data.x_test, expected_x(arrays["test_images"]))


def test_data_dir_with_both_copies_of_a_file(tmp_path: Path) -> None:
    """gunzip -k leaves X.gz and X: the same data is fine, other data is refused, not read."""
    arrays = small_arrays(seed=5)
    directory = write_mnist_dir(tmp_path / "d", arrays)
    raw = directory / "train-labels-idx1-ubyte"
    write_idx(raw, arrays["train_labels"])
    data = load_dataset("mnist", data_dir=directory)
    np.testing.assert_array_equal(data.y_train, arrays["train_labels"])
    write_idx(raw, (arrays["train_labels"] + 1) % 10)  # relabelled since
    with pytest.raises(UserError) as info:
        load_dataset("mnist", data_dir=directory)
    assert str(info.value) == (
        f"`data_dir` {directory}: train-labels-idx1-ubyte.gz and train-labels-idx1-ubyte hold "
        "different data; remove the one not meant"
    )


def test_data_dir_missing_file(tmp_path: Path) -> None:
    directory = write_mnist_dir(tmp_path / "d")
    (directory / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(UserError) as info:
        load_dataset("mnist", data_dir=directory)
    message = str(info.value)
    assert "\n" not in message and str(directory) in message
    assert "t10k-labels-idx1-ubyte.gz" in message and "train-images" not in message


def test_data_dir_entry_that_is_not_a_file(tmp_path: Path) -> None:
    directory = write_mnist_dir(tmp_path / "d")
    (directory / "t10k-labels-idx1-ubyte.gz").unlink()
    (directory / "t10k-labels-idx1-ubyte.gz").mkdir()
    with pytest.raises(UserError) as info:
        load_dataset("mnist", data_dir=directory)
    assert (
        str(info.value) == f"`data_dir` {directory}: missing t10k-labels-idx1-ubyte.gz (not a file)"
    )


def test_data_dir_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such directory"):
        load_dataset("mnist", data_dir=tmp_path / "nowhere")
    afile = tmp_path / "afile"
    afile.write_bytes(b"")
    with pytest.raises(UserError) as info:  # it said "no such directory" too
        load_dataset("mnist", data_dir=afile)
    assert str(info.value) == f"`data_dir` {afile}: not a directory"


def test_data_dir_corrupt_file_is_idx_error(tmp_path: Path) -> None:
    directory = write_mnist_dir(tmp_path / "d")
    bad = directory / "train-labels-idx1-ubyte.gz"
    bad.write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x64"))
    with pytest.raises(IdxError, match=f"^{bad}: truncated"):
        load_dataset("mnist", data_dir=directory)


def test_test_images_must_match_train_size(tmp_path: Path) -> None:
    arrays = small_arrays()
    arrays["test_images"] = np.zeros((50, 14, 14), np.uint8)
    with pytest.raises(IdxError, match="t10k-images-idx3-ubyte.gz: images are 14x14"):
        load_dataset("mnist", data_dir=write_mnist_dir(tmp_path / "d", arrays))


@pytest.mark.parametrize(
    "role, shape, name",
    [
        ("train_images", (0, 28, 28), "train-images-idx3-ubyte.gz"),  # was "training diverged"
        ("test_images", (0, 28, 28), "t10k-images-idx3-ubyte.gz"),  # was a test score of 0
        ("train_images", (50, 0, 28), "train-images-idx3-ubyte.gz"),  # was ZeroDivisionError
    ],
)
def test_image_files_without_pixels_are_refused(tmp_path: Path, role, shape, name) -> None:
    arrays = small_arrays()
    arrays[role] = np.zeros(shape, np.uint8)
    labels = role.replace("images", "labels")
    arrays[labels] = arrays[labels][: shape[0]]
    with pytest.raises(IdxError, match=f"{name}: holds no pixels to learn from"):
        load_dataset("mnist", data_dir=write_mnist_dir(tmp_path / "d", arrays))


def test_pixels_must_be_bytes(tmp_path: Path) -> None:
    arrays = small_arrays()
    arrays["train_images"] = arrays["train_images"].astype(np.int16)
    with pytest.raises(IdxError, match="pixels are int16"):
        load_dataset("mnist", data_dir=write_mnist_dir(tmp_path / "d", arrays))


# --- the download cache -------------------------------------------------------------------------


@pytest.fixture
def mnist_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A local MNIST mirror of small files, with the hash table patched to match them."""
    root = write_mnist_dir(tmp_path / "www")
    monkeypatch.setitem(ds.SHA256, "mnist", {n: sha256_file(root / n) for n in NAMES.values()})
    server = Server(root)
    monkeypatch.setenv("XPNN_MNIST_MIRRORS", f"{dead_url()}, {server.url}")
    yield server
    server.close()


def test_download_then_reuse_cache(mnist_server: Server, offline: Path) -> None:
    check_image_dataset(load_dataset("mnist"), 100, 50)
    assert len(mnist_server.requests) == 4
    assert sorted(p.name for p in (offline / "mnist").iterdir()) == sorted(NAMES.values())
    check_image_dataset(load_dataset("mnist", download=False), 100, 50)
    check_image_dataset(load_dataset("mnist"), 100, 50)
    assert len(mnist_server.requests) == 4


def test_fashion_without_system_copy_downloads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offline: Path
) -> None:
    source = dataclasses.replace(ds.SOURCES["fashion-mnist"], system_dir=tmp_path / "absent")
    monkeypatch.setitem(ds.SOURCES, "fashion-mnist", source)
    root = write_mnist_dir(tmp_path / "www")
    hashes = {n: sha256_file(root / n) for n in NAMES.values()}
    monkeypatch.setitem(ds.SHA256, "fashion-mnist", hashes)
    server = Server(root)
    try:
        monkeypatch.setenv("XPNN_FASHION_MNIST_MIRRORS", server.url)
        check_image_dataset(load_dataset("fashion-mnist"), 100, 50)
    finally:
        server.close()
    assert (offline / "fashion-mnist" / "train-images-idx3-ubyte.gz").is_file()


def test_no_download_and_empty_cache(offline: Path) -> None:
    with pytest.raises(UserError, match="downloading is off") as info:
        load_dataset("mnist", download=False)
    assert str(offline / "mnist") in str(info.value)


@pytest.mark.parametrize("download", [True, False])
def test_other_files_put_in_the_cache_are_refused_and_kept(
    tmp_path: Path, offline: Path, download: bool
) -> None:
    """As the README suggests for offline use, but files other than the expected ones (here
    small IDX files): they are refused and kept, not deleted with only the mirrors' errors to
    show for it."""
    cache = write_mnist_dir(offline / "mnist")
    before = {p.name: p.read_bytes() for p in cache.iterdir()}
    images = cache / "train-images-idx3-ubyte.gz"
    with pytest.raises(UserError) as info:
        load_dataset("mnist", download=download)
    got, expected = sha256_file(images), ds.SHA256["mnist"][images.name]
    assert str(info.value) == (
        f"{images}: the cached file's SHA-256 is {got[:12]}..., not the expected "
        f"{expected[:12]}...; remove or replace it"
    )
    assert {p.name: p.read_bytes() for p in cache.iterdir()} == before


def test_a_directory_in_place_of_a_cached_file(offline: Path) -> None:
    """One line naming the path, not "xpnn: IsADirectoryError: [Errno 21] Is a directory"."""
    (offline / "mnist" / "train-images-idx3-ubyte.gz").mkdir(parents=True)
    for download in (True, False):
        with pytest.raises(UserError) as info:
            load_dataset("mnist", download=download)
        assert str(info.value) == (
            f"{offline / 'mnist' / 'train-images-idx3-ubyte.gz'}: in the download cache but a "
            "directory, not a file; remove it"
        )


def test_a_directory_in_place_of_a_cached_file_exits_2(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "mnist" / "train-images-idx3-ubyte.gz").mkdir(parents=True)
    proc = run_xpnn(
        ["--dataset", "mnist", "--epochs", "1", "--no-progress"],
        env={"XPNN_DATA_HOME": str(cache), "XPNN_MNIST_MIRRORS": dead_url()},
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [
        f"xpnn: {cache / 'mnist' / 'train-images-idx3-ubyte.gz'}: in the download cache but a "
        "directory, not a file; remove it"
    ]


def test_unreachable_mirrors_is_one_line_error() -> None:
    with pytest.raises(UserError) as info:
        load_dataset("mnist")
    assert "\n" not in str(info.value) and "connection refused" in str(info.value)


def test_mirror_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XPNN_MNIST_MIRRORS", " http://a/ ,, http://b ")
    assert ds.mirrors_for("mnist") == ["http://a/", "http://b"]
    monkeypatch.setenv("XPNN_MNIST_MIRRORS", "")
    assert ds.mirrors_for("mnist") == list(ds.SOURCES["mnist"].mirrors)


# --- names, replication -------------------------------------------------------------------------


def test_unknown_dataset() -> None:
    with pytest.raises(UserError) as info:
        load_dataset("cifar")
    expected = "`dataset`: unknown dataset 'cifar' (choose mnist, fashion-mnist, synthetic, "
    expected += "tinyshakespeare, text)"
    assert str(info.value) == expected


def test_replicate_repeats_train_only_without_copies(tmp_path: Path) -> None:
    directory = write_mnist_dir(tmp_path / "d")
    one = load_dataset("mnist", data_dir=directory)
    three = load_dataset("mnist", data_dir=directory, replicate=3)
    n = len(one.x_train)
    assert three.n_train == 3 * n and three.train_repeats == 3
    samples = np.arange(3 * n)
    rows = three.stored_rows(samples)
    np.testing.assert_array_equal(three.x_train[rows], np.concatenate([one.x_train] * 3))
    np.testing.assert_array_equal(three.y_train[rows], np.tile(one.y_train, 3))
    np.testing.assert_array_equal(three.x_test, one.x_test)
    assert three.x_train.nbytes == one.x_train.nbytes  # stored once, not three times
    two = load_dataset("synthetic", synthetic_size=50, replicate=2)
    assert two.n_train == 100 and len(two.x_train) == 50
    assert ds.replicate_train(two, 3).n_train == 300  # repeats of repeats multiply
    np.testing.assert_array_equal(one.stored_rows(np.arange(n)), np.arange(n))


def test_replicate_trains_as_the_repeated_files_do(tmp_path: Path) -> None:
    """--replicate 3 without copies against a training file holding the samples 3 times: the
    same run to the bit (the CNN's dropout draws by sample number, which must not change)."""
    arrays = small_arrays(n_train=40, n_test=16)
    once = write_mnist_dir(tmp_path / "once", arrays)
    thrice = dict(arrays)
    thrice["train_images"] = np.concatenate([arrays["train_images"]] * 3)
    thrice["train_labels"] = np.tile(arrays["train_labels"], 3)
    thrice_dir = write_mnist_dir(tmp_path / "thrice", thrice)
    common = ["--dataset", "mnist", "--model", "cnn", "--epochs", "1", "--batch-size", "32"]
    common += ["--dtype", "float64", "--backend", "numpy", "--no-progress"]
    a, ma, pa = train_and_load(tmp_path, 1, [*common, "--data-dir", str(once), "--replicate", "3"])
    b, mb, _ = train_and_load(tmp_path, 1, [*common, "--data-dir", str(thrice_dir)])
    assert "mnist 120 train / 16 test" in pa.stdout
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert ma[0]["train_loss"] == mb[0]["train_loss"]


def test_a_replicate_whose_epoch_order_cannot_fit_is_a_memory_error_at_once() -> None:
    with pytest.raises(MemoryError):  # the CLI makes it a one-line --replicate error
        load_dataset("synthetic", synthetic_size=1000, replicate=10**14)


@pytest.mark.parametrize("k", [0, -1, 1.5, True])
def test_replicate_must_be_positive_integer(k) -> None:
    with pytest.raises(UserError, match="^`replicate`: "):
        load_dataset("synthetic", synthetic_size=10, replicate=k)


def test_dataset_is_frozen() -> None:
    data = load_dataset("synthetic", synthetic_size=10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        data.name = "x"


# --- synthetic ----------------------------------------------------------------------------------


def test_synthetic_shapes_and_ranges() -> None:
    data = load_dataset("synthetic")
    check_image_dataset(data, 6000, 1000)
    assert data.name == "synthetic"
    assert set(np.unique(data.y_train)) == set(range(10))
    assert len(load_dataset("synthetic", synthetic_size=12000).x_test) == 2000


def test_synthetic_flat_shape() -> None:
    data = load_dataset("synthetic", synthetic_size=500, synthetic_shape=(32,))
    assert data.x_train.shape == (500, 32) and data.input_shape == (32,)
    assert data.x_test.shape == (1000, 32)


def test_synthetic_deterministic_per_seed() -> None:
    a, b = (load_dataset("synthetic", synthetic_size=300, seed=7) for _ in range(2))
    c = load_dataset("synthetic", synthetic_size=300, seed=8)
    for field in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    assert not np.array_equal(a.x_train, c.x_train)


def test_synthetic_is_learnable() -> None:
    """A nearest-class-mean classifier fit on train does far better than chance on test."""
    data = load_dataset("synthetic", synthetic_size=2000, seed=1)
    x_train = data.x_train.reshape(len(data.x_train), -1)
    x_test = data.x_test.reshape(len(data.x_test), -1)
    means = np.stack([x_train[data.y_train == k].mean(0) for k in range(10)])
    distances = (x_test**2).sum(1)[:, None] - 2 * x_test @ means.T + (means**2).sum(1)
    assert (distances.argmin(1) == data.y_test).mean() > 0.9


@pytest.mark.parametrize(
    "kwargs, param",
    [({"synthetic_size": 0}, "synthetic_size"), ({"seed": -1}, "seed")],
)
def test_synthetic_bad_arguments(kwargs: dict, param: str) -> None:
    with pytest.raises(UserError, match=f"^`{param}`: ") as info:
        load_dataset("synthetic", **kwargs)
    assert info.value.param == param


def test_synthetic_larger_than_memory_is_refused_before_allocating(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each array alone may be one the kernel promises, yet together they overfill memory:
    the OOM killer, not an error. The total is checked against the machine first."""
    monkeypatch.setattr(ds, "_memory_bytes", lambda: 50 * 2**20)
    tracemalloc.start()
    try:
        with pytest.raises(MemoryError) as info:
            load_dataset("synthetic", synthetic_size=20_000)  # 63 MB of images, 0.3 of labels
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(info.value) == (
        "20,000 samples of 1x28x28 and 3,333 test samples need 0.1 GiB, more than this "
        "machine's 0.0 GiB of memory and swap"
    )
    assert peak < 2**20
    load_dataset("synthetic", synthetic_size=10_000)  # 36 MB in all: fits


def test_synthetic_images_are_allocated_before_the_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    """--synthetic-size 2147483647 drew 16 GiB of labels and 16 of brightness (and met the OOM
    killer) before asking for the 6 TiB of images that could never fit. Here the images are
    refused, as ones too large are: nothing sizeable may have been allocated before them."""
    monkeypatch.setattr(ds, "_memory_bytes", lambda: None)  # unknown: no total check
    real_empty = np.empty

    def refuse_images(shape, dtype=float, *args, **kwargs):
        if np.ndim(shape) and shape[0] == 1_000_000:  # the images, not NumPy's own uses
            raise MemoryError("Unable to allocate the images")
        return real_empty(shape, dtype, *args, **kwargs)

    monkeypatch.setattr(np, "empty", refuse_images)
    tracemalloc.start()
    try:
        with pytest.raises(MemoryError, match="Unable to allocate the images"):
            load_dataset("synthetic", synthetic_size=1_000_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20  # before: 8 MB of labels, then 8 MB of brightness


def test_machine_memory_is_known() -> None:
    assert ds._memory_bytes() >= 2**28


def test_oversized_synthetic_set_is_one_line_error(tmp_path: Path) -> None:
    """The reviewer's command, under a 4 GiB address-space limit so that nothing can reach the
    OOM killer whatever the code does."""
    limited = (
        "import resource, runpy, sys; "
        "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
        "sys.argv[0] = 'xpnn'; runpy.run_module('xpnn', run_name='__main__')"
    )
    args = ["--dataset", "synthetic", "--synthetic-size", "2147483647", "--epochs", "1"]
    proc = subprocess.run(
        [sys.executable, "-c", limited, *args, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith(
        "xpnn: --synthetic-size 2147483647: the data set does not fit in memory (2,147,483,647 "
        "samples of 1x28x28"
    )
