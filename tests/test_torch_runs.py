"""The torch backend under real ``mpiexec``: data, tensor and pipeline parallelism on 2 ranks
equal the one-rank NumPy run (float64), the CNN preset too, and checkpoints cross between
NumPy and PyTorch both ways (the state they hold bit for bit)."""

import json

import numpy as np
import pytest
from conftest import CNN_DROPOUT_RUN, TINY_FLOAT64_RUN, run_xpnn, train_and_load
from test_checkpoints import _assert_same, _load

MLP = [*TINY_FLOAT64_RUN, "--hidden", "96,64"]  # a tensor-parallel pair and one more layer
TORCH = ["--backend", "torch", "--device", "cpu"]


@pytest.fixture(scope="module")
def numpy_run(tmp_path_factory):
    """The one-rank NumPy run: its epoch-1 and epoch-2 checkpoints and final parameters."""
    tmp = tmp_path_factory.mktemp("numpy")
    saved = tmp / "final.npz"
    proc = run_xpnn([*MLP, "--checkpoint-dir", str(tmp / "ck"), "--save", str(saved)])
    assert proc.returncode == 0, proc.stderr
    return tmp / "ck", _load(saved)


@pytest.mark.mpi
@pytest.mark.parametrize("parallel", ["data", "tensor", "pipeline"])
def test_two_torch_ranks_compute_the_one_rank_numpy_run(tmp_path, numpy_run, parallel):
    _, final = numpy_run
    params, records, proc = train_and_load(tmp_path, 2, [*MLP, *TORCH, "--parallel", parallel])
    assert records[-1]["backend"] == "torch" and records[-1]["world_size"] == 2
    assert "comm mpi-host" in proc.stdout
    _assert_same(params, final, f"torch, {parallel} parallel on 2 ranks")


@pytest.mark.mpi
def test_cnn_preset_with_dropout_on_two_torch_ranks_equals_one_numba_rank(tmp_path):
    want, _, _ = train_and_load(tmp_path, 1, CNN_DROPOUT_RUN)
    got, records, _ = train_and_load(tmp_path, 2, [*CNN_DROPOUT_RUN, *TORCH])
    assert records[-1]["params"] == 690590 and records[-1]["ranks_agree"]
    # torch's and Numba's GEMMs add in different orders: equal to 1e-10 of each array's scale
    _assert_same(got, want, "the CNN on 2 torch ranks")


@pytest.mark.parametrize(
    "writer, reader", [([], TORCH), (TORCH, [])], ids=["np-to-torch", "torch-to-np"]
)
def test_a_checkpoint_resumes_on_the_other_backend(tmp_path, numpy_run, writer, reader):
    """Written after epoch 1 by one backend, resumed by the other: the state arrives bit for
    bit (a finished run re-saved), and the resumed epoch 2 is the uninterrupted NumPy run's."""
    numpy_ck, final = numpy_run
    ck = tmp_path / "ck"
    first = run_xpnn([*MLP, *writer, "--epochs", "1", "--checkpoint-dir", str(ck)])
    assert first.returncode == 0, first.stderr
    written = _load(ck / "checkpoint-epoch0001.npz")
    _assert_same(written, _load(numpy_ck / "checkpoint-epoch0001.npz"), "the checkpoint")

    again = tmp_path / "again.npz"
    args = [*MLP, *reader, "--epochs", "1", "--checkpoint-dir", str(ck), "--resume"]
    same = run_xpnn([*args, "--save", str(again)])
    assert same.returncode == 0 and "nothing to train" in same.stdout, same.stderr
    for name, value in _load(again).items():
        np.testing.assert_array_equal(value, written[name], err_msg=name)

    saved = tmp_path / "resumed.npz"
    args = [*MLP, *reader, "--checkpoint-dir", str(ck), "--resume", "--save", str(saved)]
    second = run_xpnn(args)
    assert second.returncode == 0 and "(epoch 1, step 5)" in second.stdout, second.stderr
    _assert_same(_load(saved), final, "the resumed run")
    _assert_same(
        _load(ck / "checkpoint-epoch0002.npz"),
        _load(numpy_ck / "checkpoint-epoch0002.npz"),
        "the epoch-2 checkpoint",
    )


def test_node_shared_memory_is_refused_for_torch_in_one_line():
    proc = run_xpnn([*MLP, *TORCH, "--comm", "mpi-shm", "--epochs", "1"], ranks=2)
    assert proc.returncode == 2, proc.stderr
    assert "--comm mpi-shm: node-shared memory holds NumPy arrays, not torch's" in proc.stderr


@pytest.mark.mpi
def test_a_torch_data_parallel_trace_shows_its_allreduces(tmp_path):
    """The flight recorder's and the tracer's hooks see torch tensors' allreduces too."""
    trace = tmp_path / "trace"
    args = [*MLP, *TORCH, "--comm", "mpi-host", "--bucket-mb", "0.01", "--trace", str(trace)]
    proc = run_xpnn(args, ranks=2)
    assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        trace_file = json.loads((trace / f"trace-rank{rank}.json").read_text())
        assert trace_file["otherData"]["xpnn"]["backend"] == "torch"
        spans = [e for e in trace_file["traceEvents"] if e.get("ph") == "X"]
        reduces = [e for e in spans if e["cat"] == "communication" and "allreduce" in e["name"]]
        assert len(reduces) >= 2 and any(e["name"].startswith("forward ") for e in spans)
