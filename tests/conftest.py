"""Shared test helpers: run the real CLI, alone or under a real ``mpiexec``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

# Test modules share helpers by module name (``from test_idx import small_arrays``) across the
# folders that mirror the source tree, so each such folder is importable from every other.
for _folder in sorted(Path(__file__).parent.iterdir()):
    if (
        _folder.is_dir()
        and _folder.name != "__pycache__"
        and not (_folder / "__init__.py").exists()
    ):
        sys.path.append(str(_folder))

FASHION_DIR = Path("/usr/share/datasets/fashion-mnist")


def cupy_or_skip():  # noqa: ANN201 - the cupy module
    """CuPy with a CUDA device, or the calling test module skipped, saying which is missing
    (as in CI): for the top of each file in tests/gpu/."""
    try:
        import cupy

        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # ImportError, or CUDARuntimeError without a driver
        pytest.skip(f"no usable CuPy/CUDA device: {exc}", allow_module_level=True)
    if count < 1:
        pytest.skip("no CUDA device: getDeviceCount() == 0", allow_module_level=True)
    return cupy


# The multi-rank equivalence runs: 300 synthetic samples, global batch 70 (5 batches, the last
# of 20; 70 splits 24/23/23 on 3 ranks), 2 epochs of Adam in float64, one thread per rank.
TINY_FLOAT64_RUN = [
    "--dataset", "synthetic", "--synthetic-size", "300", "--epochs", "2", "--batch-size", "70",
    "--dtype", "float64", "--optimizer", "adam", "--lr", "0.01", "--no-progress",
    "--threads", "1", "--backend", "numpy",
]  # fmt: skip


# The CNN (convolutions, pooling, dropout) for the equivalence runs: 96 synthetic samples,
# global batch 30, 2 epochs of Adam in float64 on the numba backend, one thread per rank.
CNN_DROPOUT_RUN = [
    "--model", "cnn", "--dataset", "synthetic", "--synthetic-size", "96", "--batch-size", "30",
    "--epochs", "2", "--dtype", "float64", "--backend", "numba", "--threads", "1", "--lr",
    "0.003", "--no-progress",
]  # fmt: skip


def mpiexec_path() -> str:
    """``$XPNN_TEST_MPIEXEC`` (ci/gpu.sh: the CUDA-aware MPI's), else the mpiexec next to this
    Python (the mpich wheel's), else the one on PATH."""
    forced = os.environ.get("XPNN_TEST_MPIEXEC")
    if forced:
        return forced
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        pytest.fail("mpiexec not found: install the 'mpich' wheel (pip install mpich)")
    return found


def xpnn_cmd(args: list[str], ranks: int = 1) -> list[str]:
    """The command line that runs ``python -m xpnn ARGS`` on ``ranks`` real MPI processes."""
    base = [sys.executable, "-m", "xpnn", *args]
    if ranks == 1:
        return base
    return [mpiexec_path(), "-n", str(ranks), *base]


def run_xpnn(
    args: list[str], ranks: int = 1, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run the CLI and capture its output; a hang fails the test instead of the suite."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        xpnn_cmd(args, ranks),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=full_env,
    )


TrainResult = tuple[dict[str, np.ndarray], list[dict], subprocess.CompletedProcess]

# The 1-rank reference runs the equivalence tests compare against, by their arguments: many
# tests (and modules) compare other layouts against the same deterministic 1-rank run, which
# is then trained once per pytest run. Runs that write or read files other than --save and
# --metrics (checkpoints, traces) are always run afresh.
_ONE_RANK_RUNS: dict[tuple[str, ...], TrainResult] = {}
_NOT_CACHED = ("--checkpoint-dir", "--resume", "--trace", "--save", "--metrics")


def _copied(result: TrainResult) -> TrainResult:
    """A copy a test may change without changing what the next test is given."""
    params, records, proc = result
    return {k: v.copy() for k, v in params.items()}, json.loads(json.dumps(records)), proc


def train_and_load(tmp_path: Path, ranks: int, args: list[str]) -> TrainResult:
    """Train with ``--save`` and ``--metrics``: (saved parameters, metrics records, process).
    A 1-rank run of arguments already trained in this pytest run is that run's result."""
    key = tuple(args)
    cacheable = ranks == 1 and not any(flag in key for flag in _NOT_CACHED)
    if cacheable and key in _ONE_RANK_RUNS:
        return _copied(_ONE_RANK_RUNS[key])
    saved = tmp_path / f"{ranks}-{abs(hash(key))}.npz"
    metrics = saved.with_suffix(".jsonl")
    proc = run_xpnn([*args, "--save", str(saved), "--metrics", str(metrics)], ranks=ranks)
    assert proc.returncode == 0, proc.stderr
    with np.load(saved) as data:
        params = {k: data[k] for k in data.files}
    result = params, [json.loads(line) for line in metrics.read_text().splitlines()], proc
    if cacheable:
        _ONE_RANK_RUNS[key] = _copied(result)
    return result


def assert_failing_rank_stops_the_job(args: list[str], ranks: int = 2, rank: int = 1) -> None:
    """``rank`` raises at step 3 (``XPNN_FAIL_AT``): every rank exits non-zero within 30 s,
    and the message names the rank once."""
    start = time.monotonic()
    proc = run_xpnn(args, ranks=ranks, timeout=60, env={"XPNN_FAIL_AT": f"{rank}:3"})
    assert proc.returncode != 0
    assert time.monotonic() - start < 30
    assert proc.stderr.count(f"rank {rank}:") == 1, proc.stderr
    assert "injected failure at step 3" in proc.stderr


def assert_one_line_user_error(proc: subprocess.CompletedProcess, message: str) -> None:
    """Exit 2 with ``message`` as the last line, printed once (not per rank), no traceback."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert [line for line in lines if message in line] == [lines[-1]]
    assert sum(message in line for line in lines) == 1
    assert "Traceback" not in proc.stderr


def _without_root_rights() -> list[str]:
    """A command prefix that takes away root's right to ignore file modes, so that a directory
    of mode 000 stops root too (CI runs as root); nothing for anyone else."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")  # util-linux, on every Debian
    assert setpriv, "setpriv is needed to test file permissions as root"
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search"]


def run_locked_out(
    args: list[str], locked: Path, timeout: float = 120
) -> subprocess.CompletedProcess:
    """``python ARGS`` (from the project root) while the directory ``locked`` has mode 000,
    as a user who may not enter it (root's rights taken away)."""
    locked.chmod(0)
    try:
        return subprocess.run(
            [*_without_root_rights(), sys.executable, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
    finally:
        locked.chmod(0o700)


def run_with_stdout_closed(args: list[str], timeout: float = 120) -> tuple[int, str]:
    """``python ARGS | head -0``: stdout's reader has gone before the first line, so every
    print finds the pipe closed. The exit code and stderr."""
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    proc.stdout.close()
    try:
        err = proc.stderr.read()
        return proc.wait(timeout=timeout), err
    finally:
        proc.kill()
        proc.stderr.close()


def run_bench(
    *args: str, timeout: float = 300, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``python -m bench ARGS`` from the project root, its output captured, no stdin."""
    return subprocess.run(
        [sys.executable, "-m", "bench", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def fashion_dir() -> Path:
    """Debian's dataset-fashion-mnist; CI installs it, so its absence is a failure, not a skip."""
    if not (FASHION_DIR / "train-images-idx3-ubyte.gz").exists():
        pytest.fail(f"{FASHION_DIR} missing: apt-get install dataset-fashion-mnist")
    return FASHION_DIR


@pytest.fixture(autouse=True)
def _thread_variables_put_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test that runs xpnn in this process sets ``OMP_NUM_THREADS`` and the like
    (``apply_threads``); the processes later tests start would inherit them, and take them
    for the user's (``xpnn: note: OMP_NUM_THREADS=1 in the environment ...``)."""
    from xpnn.backends import THREAD_VARS

    for var in THREAD_VARS:
        if var in os.environ:
            monkeypatch.setenv(var, os.environ[var])
        else:  # delenv alone records nothing to undo for a variable that is not there
            monkeypatch.setenv(var, "")
            monkeypatch.delenv(var)


def cnn_preset_step(backend):
    """The 690,590-parameter CNN, built from seed 11, on one batch of 6 with dropout drawn from
    fixed sample ids: (model, logits, loss, gradients on the host), to compare backends."""
    from xpnn.nn import Context, cnn

    model = cnn().build((1, 28, 28), backend, seed=11)
    rng = np.random.default_rng(4)
    x = backend.asarray(rng.random((6, 1, 28, 28)))
    y = backend.asarray(rng.integers(0, 10, 6), dtype=backend.xp.int64)
    ids = backend.asarray(np.array([5, 900, 17, 3, 60000, 42]), dtype=backend.xp.int64)
    ctx = Context(train=True, step=3, seed=7, sample_ids=ids)
    logits = backend.to_host(model.forward(x, ctx)).copy()
    loss, _ = model.loss_and_grads(x, y, ctx, 1 / 6)
    return model, logits, float(loss), backend.to_host(model.grads).copy()
