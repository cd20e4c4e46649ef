"""``batch_threads``: a rank's batch cut over threads, each part run by a twin of the model.
The twins share the parameters, never the gradients or a layer's scratch; the summed step
equals the whole batch's in float64 (dropout masks too), with the model's ready reports."""

import numpy as np
import pytest
from conftest import CNN_DROPOUT_RUN, assert_one_line_user_error, run_xpnn, train_and_load

from xpnn.backends import get_backend
from xpnn.nn import gpt
from xpnn.nn.layer import Context
from xpnn.nn.models import cnn, mlp
from xpnn.parallel.model.batch_threads import BatchThreads, twin


def _gpt(backend):
    return gpt(7, layers=2, heads=2, embed=8, block=6).build((6,), backend, 3)


def _text_batch(rng, n):
    return rng.integers(0, 7, (n, 6)), rng.integers(0, 7, (n, 6))


def _cnn(backend):
    model = cnn(channels=(4, 6), dense=(10,), dropout=0.5)
    return model.build((1, 12, 12), backend, 3)


def _image_batch(rng, n):
    return rng.standard_normal((n, 1, 12, 12)), rng.integers(0, 10, n)


def test_a_twin_shares_the_parameters_and_keeps_its_own_gradients():
    model = _gpt(get_backend("numpy", "float64"))
    other = twin(model)
    assert other.params is model.params and other.grads is not model.grads
    x, y = _text_batch(np.random.default_rng(0), 5)
    model.loss_and_grads(x, y, Context(train=True), 0.2)
    before = model.grads.copy()
    other.loss_and_grads(x[:2], y[:2], Context(train=True), 0.2)
    np.testing.assert_array_equal(model.grads, before)  # the twin wrote only its own
    assert np.abs(other.grads).max() > 0
    model.params[:] += 1.0  # an update of the model's is the twin's
    for key, value in other.named_params().items():
        np.testing.assert_array_equal(value, model.named_params()[key])


@pytest.mark.parametrize("count, n", [(2, 9), (3, 9), (3, 2), (4, 3)])
@pytest.mark.parametrize(
    "build, batch, backend",
    [(_gpt, _text_batch, "numba"), (_cnn, _image_batch, "numba"), (_gpt, _text_batch, "numpy")],
    ids=["gpt-numba", "cnn-dropout-numba", "gpt-numpy"],
)
def test_threads_compute_the_whole_batch_step(count, n, build, batch, backend):
    """Loss, correct count and every gradient as one pass over the batch (fewer samples than
    threads leave some twins idle, the model's own among them), ready reported as it does."""
    be = get_backend(backend, "float64")
    whole, split = build(be), build(be)
    x, y = batch(np.random.default_rng(1), n)
    ctx = Context(train=True, step=4, seed=2, sample_ids=np.arange(10, 10 + n))
    heard, seen = [], []
    loss, correct = whole.loss_and_grads(x, y, ctx, 1 / n, heard.append)
    threads = BatchThreads(split, count)
    for _ in range(2):  # a second step: the twins' gradients are assigned, not added to
        seen.clear()
        got_loss, got_correct = threads.loss_and_grads(x, y, ctx, 1 / n, seen.append)
    evaluated = [float(v) for v in threads.evaluate(x, y)]
    threads.close()
    assert evaluated == pytest.approx([float(v) for v in whole.evaluate(x, y)], rel=1e-12)
    assert float(got_loss) == pytest.approx(float(loss), rel=1e-12)
    assert float(got_correct) == pytest.approx(float(correct), rel=1e-12)  # text: a fraction
    np.testing.assert_allclose(split.grads, whole.grads, rtol=1e-10, atol=1e-13)
    assert seen == heard


def test_mlp_twins_run_at_once_in_float32():
    """The threads really overlap here (float32, Numba, a batch past the kernels' parallel
    size): the serial kernels are taken on a batch thread, and the sum is the whole step's."""
    be = get_backend("numba", "float32")
    whole = mlp((1024, 512)).build((784,), be, 0)
    split = mlp((1024, 512)).build((784,), be, 0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2048, 784)).astype(np.float32)
    y = rng.integers(0, 10, 2048)
    whole.loss_and_grads(x, y, Context(train=True), 1 / 2048)
    threads = BatchThreads(split, 2)
    threads.loss_and_grads(x, y, Context(train=True), 1 / 2048)
    threads.close()
    np.testing.assert_allclose(split.grads, whole.grads, rtol=2e-3, atol=2e-6)


GPT_TINY = [
    "--model", "gpt", "--layers", "2", "--heads", "2", "--embed", "8", "--block", "6",
    "--batch-size", "24", "--steps", "4", "--dtype", "float64", "--warmup-steps", "1",
    "--clip-norm", "0.05", "--threads", "1", "--no-progress",
    "--backend", "numpy",
]  # fmt: skip


def _corpus(tmp_path) -> str:
    rng = np.random.default_rng(0)
    words = ["to", "be", "or", "not", "the", "king", "queen", "shall", "my", "lord"]
    path = tmp_path / "corpus.txt"
    path.write_text(" ".join(rng.choice(words, 900)) + "\n", encoding="utf-8")
    return str(path)


@pytest.mark.parametrize(
    "ranks, extra",
    [
        (1, ["--threads", "2", "--batch-threads", "2"]),
        (2, ["--threads", "3", "--batch-threads", "3", "--accumulate", "2"]),
    ],
    ids=["one-rank", "two-ranks-accumulating"],
)
def test_the_command_line_run_is_the_one_thread_run(tmp_path, ranks, extra):
    args = [*GPT_TINY, "--dataset", "text", "--data-dir", _corpus(tmp_path)]
    one, rec1, _ = train_and_load(tmp_path, 1, args)
    got, rec, proc = train_and_load(tmp_path, ranks, [*args, *extra])
    for name in one:
        scale = np.abs(one[name]).max()
        np.testing.assert_allclose(got[name], one[name], rtol=1e-9, atol=1e-9 * scale)
    assert rec[-1]["test_loss"] == pytest.approx(rec1[-1]["test_loss"], rel=1e-9)
    threads = extra[extra.index("--threads") + 1]
    assert rec[-1]["batch_threads"] == int(threads)
    assert f"x {threads} thread(s), {threads} of them batch threads" in proc.stdout


def test_a_cnn_with_dropout_over_batch_threads_is_the_one_thread_run(tmp_path):
    """Under Numba's workqueue layer too, which aborts the process when two threads launch
    parallel kernels at once: batch threads run every kernel's serial build."""
    one, _, _ = train_and_load(tmp_path, 1, CNN_DROPOUT_RUN)
    saved = tmp_path / "threads.npz"
    args = [*CNN_DROPOUT_RUN, "--threads", "2", "--batch-threads", "2", "--save", str(saved)]
    proc = run_xpnn(args, env={"NUMBA_THREADING_LAYER": "workqueue"})
    assert proc.returncode == 0, proc.stderr
    with np.load(saved) as got:
        for name in one:
            np.testing.assert_allclose(got[name], one[name], rtol=1e-9, atol=1e-12, err_msg=name)


ONE_LINE_REFUSALS = {
    "not-dividing": (1, ["--threads", "2", "--batch-threads", "3"],
                     "--batch-threads 3: does not divide this rank's 2 thread(s) (--threads)"),
    "tensor": (2, ["--threads", "2", "--batch-threads", "2", "--parallel", "tensor"],
               "--batch-threads 2: only with --parallel data, not tensor"),
    "one-stage-pipeline": (1, ["--threads", "2", "--batch-threads", "2", "--parallel", "pipeline"],
                           "--batch-threads 2: only with --parallel data, not pipeline"),
    "shared-activations": (1, ["--threads", "2", "--batch-threads", "2", "--node-share",
                               "activations"],
                           "--batch-threads 2: not with --node-share activations"),
    "bf16": (1, ["--threads", "2", "--batch-threads", "2", "--precision", "bf16"],
             "--batch-threads 2: only with --precision fp32"),
    "zero": (1, ["--batch-threads", "0"], "--batch-threads: must be"),
}  # fmt: skip


@pytest.mark.parametrize(
    "ranks, extra, message", ONE_LINE_REFUSALS.values(), ids=list(ONE_LINE_REFUSALS)
)
def test_what_batch_threads_cannot_run_is_one_line(tmp_path, ranks, extra, message):
    args = [*GPT_TINY, "--dataset", "text", "--data-dir", _corpus(tmp_path)]
    assert_one_line_user_error(run_xpnn([*args, *extra], ranks=ranks), message)
