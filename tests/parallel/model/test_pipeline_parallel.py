"""Pipeline parallelism: the stage cut, micro-batch gradient sums, and real mpiexec runs."""

import itertools

import numpy as np
import pytest
from conftest import (
    CNN_DROPOUT_RUN,
    TINY_FLOAT64_RUN,
    assert_failing_rank_stops_the_job,
    assert_one_line_user_error,
    run_xpnn,
    train_and_load,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from xpnn.backends import get_backend
from xpnn.errors import UserError
from xpnn.nn import build_model
from xpnn.nn.layer import Context
from xpnn.parallel.comm import SelfCommunicator
from xpnn.parallel.model.pipeline import (
    SCHEDULES,
    build_stage,
    in_flight,
    layer_costs,
    one_f_one_b_order,
    stage_bounds,
)


# -- where the stages are cut ------------------------------------------------------------------
def _brute_force(costs, has_params, stages):
    """The smallest costliest stage over every valid cut (stages start at layers with
    parameters, the first at layer 0)."""
    starts = [i for i, p in enumerate(has_params) if p][1:]
    best = np.inf
    for cut in itertools.combinations(starts, stages - 1):
        edges = [0, *cut, len(costs)]
        best = min(best, max(sum(costs[a:b]) for a, b in itertools.pairwise(edges)))
    return best


@settings(max_examples=200, deadline=None)
@given(
    layers=st.lists(st.tuples(st.integers(0, 50), st.booleans()), min_size=1, max_size=9),
    stages=st.integers(1, 5),
)
def test_stage_bounds_are_the_best_contiguous_cut(layers, stages):
    costs = [float(c) if p else 0.0 for c, p in layers]
    has_params = [p for _, p in layers]
    if sum(has_params) < stages:
        with pytest.raises(
            UserError, match=rf"{stages} stages \(a replica's ranks\) but the model has only"
        ):
            stage_bounds(costs, has_params, stages)
        return
    bounds = stage_bounds(costs, has_params, stages)
    assert len(bounds) == stages and bounds[0][0] == 0 and bounds[-1][1] == len(costs)
    for (_, end), (start, _) in itertools.pairwise(bounds):
        assert end == start  # consecutive, nothing skipped
    for a, b in bounds:
        assert any(has_params[a:b])  # every stage holds parameters...
    for a, _ in bounds[1:]:
        assert has_params[a]  # ...and begins with them: a free layer stays with the one before
    worst = max(sum(costs[a:b]) for a, b in bounds)
    assert worst == _brute_force(costs, has_params, stages)


def test_layer_costs_count_multiply_adds_per_sample():
    model = build_model("cnn").setup((1, 28, 28), get_backend("numpy", "float32"), 0)
    costs = layer_costs(model.layers, model.shapes)
    conv1, pool1, conv2 = costs[:3]
    assert conv1 == (32 * 9 + 32) * 26 * 26  # weights and bias, at each of 26x26 positions
    assert pool1 == 0
    assert conv2 == (128 * 32 * 9 + 128) * 10 * 10  # the part of 11x11 the pooling reads
    dense = build_model("mlp", (64,)).setup((1, 28, 28), get_backend("numpy", "float32"), 0)
    assert layer_costs(dense.layers, dense.shapes)[1:] == [784 * 64 + 64, 64 * 10 + 10]


def test_the_mlp_of_the_benchmarks_is_cut_after_its_first_dense_layer():
    model = build_model("mlp", (1024, 1024)).setup((784,), get_backend("numpy", "float32"), 0)
    costs = layer_costs(model.layers, model.shapes)
    assert stage_bounds(costs, [bool(la.initial) for la in model.layers], 2) == [(0, 2), (2, 4)]


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize(("microbatches", "stages"), [(1, 1), (4, 2), (3, 3), (2, 4), (8, 3)])
def test_schedules_run_each_micro_batch_forward_then_backward_once(schedule, microbatches, stages):
    for index in range(stages):
        order = SCHEDULES[schedule](microbatches, stages, index)
        assert sorted(order) == sorted([(k, m) for m in range(microbatches) for k in "BF"])
        for m in range(microbatches):
            assert order.index(("F", m)) < order.index(("B", m))
        forwards = [m for k, m in order if k == "F"]
        assert forwards == sorted(forwards)  # stages pass activations on in order
        held = in_flight(order)
        if schedule == "gpipe":
            assert held == microbatches
        else:  # 1F1B holds S - s micro-batches' activations, not M; backwards in order
            assert held == min(stages - index, microbatches)
            assert [m for k, m in order if k == "B"] == list(range(microbatches))


def test_the_cli_offers_exactly_the_schedules_there_are():
    """The parser names them without importing the pipeline module (a fast --help)."""
    from xpnn.commands.flags import build_parser

    action = next(a for a in build_parser()._actions if a.dest == "pipeline_schedule")
    assert sorted(action.choices) == sorted(SCHEDULES)


def test_one_f_one_b_is_megatrons_order():
    """Stage 0 of 3, 5 micro-batches: two forwards ahead, alternate, then drain."""
    got = " ".join(f"{k}{m}" for k, m in one_f_one_b_order(5, 3, 0))
    assert got == "F0 F1 F2 B0 F3 B1 F4 B2 B3 B4"
    assert " ".join(f"{k}{m}" for k, m in one_f_one_b_order(5, 3, 2)) == (
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4"
    )


def test_a_schedule_that_reuses_a_set_in_flight_is_refused(monkeypatch):
    """The executor gives micro-batch m the set of m - sets; an order that forwards m before
    that one's backward would overwrite its activations: refused, not a wrong gradient."""
    bad = [("F", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 0), ("B", 2)]  # 2 in flight, F2 early
    monkeypatch.setitem(SCHEDULES, "gpipe", lambda microbatches, stages, index: bad)
    backend = get_backend("numpy", "float64")
    stage = build_stage(build_model("mlp", (8,)), (784,), backend, 0, 0, 1, 3)
    stage.comm = SelfCommunicator()
    x, y = np.ones((6, 784)), np.arange(6)
    with pytest.raises(RuntimeError, match="micro-batch 0 in flight"):
        stage.loss_and_grads(x, y, Context(train=True), 1 / 6)


def test_only_the_first_stage_reads_the_samples():
    """The trainer gathers (and on a GPU copies) the training set only where it is read."""
    backend = get_backend("numpy", "float32")
    reads = [
        build_stage(build_model("mlp", (16, 16)), (784,), backend, 0, r, 3, 2).reads_input
        for r in range(3)
    ]
    assert reads == [True, False, False]


# -- the micro-batches' gradients, on one process ----------------------------------------------
@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("microbatches", [1, 3, 7])
def test_micro_batch_gradients_sum_to_the_whole_batch_gradient(microbatches, schedule, recompute):
    """One stage, M micro-batches: the gradient is the whole batch's, and each layer's part is
    already final when backward reports it (the update starts there). Under 1F1B one stage
    holds one micro-batch at a time: one set of layers, reused M times. With ``recompute``,
    GPipe too runs every micro-batch through one set, and runs each forward again (dropout
    included) before its backward."""
    backend = get_backend("numpy", "float64")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((23, 1, 6, 6))
    y = rng.integers(0, 10, 23)
    ctx = Context(train=True, step=5, seed=1, sample_ids=np.arange(23))

    def network():
        from xpnn.nn import Flatten
        from xpnn.nn.conv import Conv2D
        from xpnn.nn.dense import Dense
        from xpnn.nn.dropout import Dropout
        from xpnn.nn.sequential import Sequential

        return Sequential([Conv2D(3, 3, activation="relu"), Flatten(), Dropout(0.3), Dense(10)])

    whole = network().build((1, 6, 6), backend, 0)
    loss, correct = whole.loss_and_grads(x, y, ctx, 1 / 23)
    stage = build_stage(network(), (1, 6, 6), backend, 0, 0, 1, microbatches, schedule, recompute)
    stage.comm = SelfCommunicator()
    np.testing.assert_array_equal(stage.params, whole.params)
    reported = []

    def ready(offset):
        reported.append(offset)
        np.testing.assert_allclose(stage.grads[offset:], whole.grads[offset:], rtol=1e-12)

    loss_p, correct_p = stage.loss_and_grads(x, y, ctx, 1 / 23, ready)
    assert sorted(set(reported)) == sorted(set(stage.layer_offsets))
    np.testing.assert_allclose(stage.grads, whole.grads, rtol=1e-12, atol=1e-15)
    assert float(loss_p) == pytest.approx(float(loss), rel=1e-12)
    assert int(correct_p) == int(correct)
    tail = f"1 stage(s), {microbatches} micro-batch(es), {schedule}"
    assert stage.summary().endswith(tail + (", recompute)" if recompute else ")"))
    assert len(stage._sets) == (microbatches if schedule == "gpipe" and not recompute else 1)


@pytest.mark.parametrize("recompute", [False, True])
def test_a_context_without_step_or_sample_ids_draws_the_whole_batch_masks(recompute):
    """A hand-written loop passes ``Context(train=True)``: the micro-batches took batch
    positions 0.. each (so their masks differed from the whole batch's), and every step drew
    the same masks."""
    from xpnn.nn import Flatten
    from xpnn.nn.dense import Dense
    from xpnn.nn.dropout import Dropout
    from xpnn.nn.sequential import Sequential

    def network():
        return Sequential([Flatten(), Dense(16, "relu"), Dropout(0.5), Dense(10)])

    backend = get_backend("numpy", "float64")
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((23, 36)), rng.integers(0, 10, 23)
    whole = network().build((36,), backend, 0)
    stage = build_stage(network(), (36,), backend, 0, 0, 1, 3, "gpipe", recompute)
    stage.comm = SelfCommunicator()
    steps = []
    for _ in range(2):
        whole.loss_and_grads(x, y, Context(train=True), 1 / 23)
        stage.loss_and_grads(x, y, Context(train=True), 1 / 23)
        np.testing.assert_allclose(stage.grads, whole.grads, rtol=1e-12, atol=1e-15)
        steps.append(stage.grads.copy())
    assert not np.allclose(steps[0], steps[1])  # the second step drew new masks


# -- real mpiexec --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, microbatches",
    [
        ([*TINY_FLOAT64_RUN, "--hidden", "96,64"], "3"),  # batch 70 = 24 + 23 + 23
        (CNN_DROPOUT_RUN, "4"),  # convolutions, pooling and dropout; batch 30 = 8 + 8 + 7 + 7
    ],
    ids=["mlp", "cnn"],
)
def test_two_and_three_stages_compute_the_one_rank_run(tmp_path, args, microbatches):
    one, rec1, _ = train_and_load(tmp_path, 1, args)
    runs = [(2, "gpipe", ""), (3, "gpipe", ""), (2, "1f1b", ""), (3, "1f1b", "")]
    runs += [(2, "gpipe", "--recompute"), (3, "1f1b", "--recompute")]
    for ranks, schedule, recompute in runs:
        pipeline = ["--parallel", "pipeline", "--microbatches", microbatches]
        pipeline += ["--pipeline-schedule", schedule, *filter(None, [recompute])]
        pp, rec, proc = train_and_load(tmp_path, ranks, [*args, *pipeline])
        assert list(pp) == list(one)  # the whole network, under the 1-rank names, in order
        for name in one:
            scale = np.abs(one[name]).max()
            np.testing.assert_allclose(pp[name], one[name], rtol=0, atol=1e-10 * scale)
        done = rec[-1]
        assert done["parallel"] == "pipeline" and done["world_size"] == ranks
        assert done["comm"] == "mpi-host"  # auto: no parameters to share between ranks
        assert done["ranks_agree"] and done["params"] == rec1[-1]["params"]
        for r1, r in zip(rec1[:2], rec[:2], strict=True):  # scored once, by the last stage
            assert r["train_loss"] == pytest.approx(r1["train_loss"], rel=1e-10)
            assert r["test_loss"] == pytest.approx(r1["test_loss"], rel=1e-10)
            assert r["train_acc"] == r1["train_acc"] and r["test_acc"] == r1["test_acc"]
        shown = f"{ranks} stage(s), {microbatches} micro-batch(es), {schedule}"
        assert shown + (", recompute)" if recompute else ")") in proc.stdout
        assert done["pipeline_schedule"] == schedule and done["recompute"] == bool(recompute)
    assert rec1[1]["train_loss"] < rec1[0]["train_loss"]  # it trained: equality is not trivial


@pytest.mark.parametrize(
    "ranks, args, message",
    [
        (
            4,
            ["--hidden", "16,16"],
            "--parallel pipeline: 4 stages (a replica's ranks) but the model has only 3",
        ),
    ],
)
def test_pipeline_user_errors_are_one_line_exit_2(ranks, args, message):
    proc = run_xpnn(
        [*TINY_FLOAT64_RUN, "--parallel", "pipeline", *args, "--epochs", "1"],
        ranks=ranks,
        timeout=120,
    )
    assert_one_line_user_error(proc, message)


@pytest.mark.parametrize(
    ("flag", "value"), [("--microbatches", "2"), ("--pipeline-schedule", "1f1b")]
)
def test_pipeline_flags_without_a_pipeline_say_they_have_no_effect(flag, value):
    proc = run_xpnn([*TINY_FLOAT64_RUN, "--hidden", "8", "--epochs", "1", flag, value])
    assert proc.returncode == 0, proc.stderr
    assert f"{flag} has no effect without --parallel pipeline" in proc.stderr


def test_one_failing_stage_stops_the_pipeline():
    """Rank 1 (the last stage) raises at step 3 while rank 0 waits for its gradients."""
    args = [*TINY_FLOAT64_RUN, "--hidden", "96,64", "--parallel", "pipeline", "--epochs", "50"]
    assert_failing_rank_stops_the_job(args)
