"""The cost model against hand-computed cases: a model's products read from its own shapes,
and each layout's step priced on a machine whose rates are round numbers."""

from __future__ import annotations

import math

import pytest

from xpnn.backends import get_backend
from xpnn.nn.models import cnn, mlp
from xpnn.planner.cost import Layout, predict
from xpnn.planner.machine import Machine
from xpnn.planner.work import DGRAD, FORWARD, WGRAD, model_work

FLOPS = 1e9  # the round machine: 1 GFLOP/s a thread, 1e9 values/s, 1 us + 1 ns a byte


class RoundMachine(Machine):
    """Products at FLOPS per thread, passes at 1e9 values/s, collectives 1 us + 1 ns/byte,
    ranks sharing cores slowed by exactly their share."""

    def __init__(self, cores: int = 2) -> None:
        super().__init__({"cores": cores}, measured=False)

    def gemm_seconds(self, m, k, n, count, threads, dtype):  # noqa: ANN001, ANN201
        return 2.0 * m * k * n * count / (FLOPS * threads)

    def values_per_s(self, threads, dtype):  # noqa: ANN001, ANN201
        return 1e9

    def collective(self, op, ranks, nbytes):  # noqa: ANN001, ANN201
        return 0.0 if ranks <= 1 or nbytes <= 0 else 1e-6 + 1e-9 * nbytes

    def slowdown(self, busy_threads):  # noqa: ANN001, ANN201
        return max(1.0, busy_threads / self.cores)


def mlp_work(hidden=(512, 256)):  # noqa: ANN001, ANN201
    return model_work(mlp(hidden), (1, 28, 28), get_backend("numpy", "float32"))


def test_the_mlps_products_are_its_layers_shapes():
    work = mlp_work()
    batch = 128
    sizes = [(784, 512), (512, 256), (256, 10)]
    by_phase = {FORWARD: 0.0, WGRAD: 0.0, DGRAD: 0.0}
    for g in work.gemms():
        by_phase[g.phase] += g.flops(batch)
    expected = sum(2 * batch * k * n for k, n in sizes)
    assert by_phase[FORWARD] == expected
    assert by_phase[WGRAD] == expected
    # the first layer's input gradient is never needed
    assert by_phase[DGRAD] == expected - 2 * batch * 784 * 512
    assert work.params == sum(k * n + n for k, n in sizes) == 535_818


def test_the_cnns_products_are_its_im2col_shapes():
    work = model_work(cnn(), (1, 28, 28), get_backend("numpy", "float32"))
    assert work.params == 690_590
    forward = [g for g in work.gemms() if g.phase == FORWARD]
    # conv 1 -> 32 on 26x26 outputs, 3x3x1 deep; conv 32 -> 128 on 11x11; 128 -> 256 on 3x3;
    # as Conv2D runs them: W (C_out x depth) @ cols (depth x positions of every sample)
    assert [(g.m, g.k, g.n) for g in forward[:3]] == [(32, 9, 676), (128, 288, 121), (256, 1152, 9)]
    assert forward[0].at(4) == (32, 9, 4 * 676, 1)
    wgrad = [g for g in work.gemms() if g.phase == WGRAD]  # the longer of depth, C_out as rows
    assert [(g.m, g.k, g.n) for g in wgrad[:3]] == [(32, 676, 9), (288, 121, 128), (1152, 9, 256)]
    dgrad = [g for g in work.gemms() if g.phase == DGRAD]
    assert [(g.m, g.k, g.n) for g in dgrad[:2]] == [(288, 128, 121), (1152, 256, 9)]


def test_a_data_parallel_step_is_its_shares_products_plus_the_exposed_exchange():
    machine, work = RoundMachine(cores=2), mlp_work()
    one = predict(machine, work, Layout(1, 2), 128, "sgd")
    two = predict(machine, work, Layout(2, 1, "data"), 128, "sgd")
    flops = work.flops(64)
    assert two.forward + two.wgrad + two.dgrad == pytest.approx(flops / FLOPS)
    assert one.forward + one.wgrad + one.dgrad == pytest.approx(work.flops(128) / (2 * FLOPS))
    grads = 4 * work.params
    buckets = math.ceil(grads / (4 << 20))
    exchange = buckets * (1e-6 + 1e-9 * grads / buckets)
    assert two.comm_exposed + two.comm_hidden == pytest.approx(exchange)
    backward = two.wgrad + two.dgrad
    last = 1e-6 + 1e-9 * min(4 << 20, grads)
    assert two.comm_exposed == pytest.approx(last + max(0.0, exchange - last - backward))
    assert one.comm_exposed == 0.0
    assert two.optimizer == pytest.approx(3 * work.params / 1e9)


def test_oversubscribed_ranks_run_slower_by_their_share_of_the_cores():
    machine, work = RoundMachine(cores=2), mlp_work()
    fits = predict(machine, work, Layout(2, 1, "data"), 128)
    crowded = predict(machine, work, Layout(4, 1, "data"), 128)
    assert crowded.slowdown == 2.0
    compute = crowded.forward + crowded.wgrad + crowded.dgrad
    assert compute == pytest.approx(2.0 * work.flops(32) / FLOPS)
    assert crowded.step > fits.step


def test_batch_threads_split_the_rows_and_add_the_gradient_sum():
    machine, work = RoundMachine(cores=2), mlp_work()
    twins = predict(machine, work, Layout(1, 2, "data", batch_threads=2), 128, "sgd")
    assert twins.forward == pytest.approx(sum(
        g.flops(64) for g in work.gemms() if g.phase == FORWARD) / FLOPS)  # fmt: skip
    assert twins.serial_tail == pytest.approx(work.params / 1e9)
    assert twins.memory["gradients"] == 2 * 4 * work.params


def test_a_pipelines_bubble_is_its_slowest_stage_times_the_stages_less_one():
    machine, work = RoundMachine(cores=2), mlp_work()
    for m in (2, 4, 8):
        p = predict(machine, work, Layout(2, 1, "pipeline", microbatches=m), 128)
        per_micro = (p.forward + p.wgrad + p.dgrad + p.elementwise) / m
        assert p.bubble == pytest.approx(per_micro)  # (stages - 1) x the slowest stage
    few = predict(machine, work, Layout(2, 1, "pipeline", microbatches=2), 128)
    many = predict(machine, work, Layout(2, 1, "pipeline", microbatches=8), 128)
    assert many.bubble < few.bubble


def test_tensor_parts_divide_the_products_and_the_parameters():
    machine, work = RoundMachine(cores=2), mlp_work()
    one = predict(machine, work, Layout(1, 1), 128)
    split = predict(machine, work, Layout(2, 1, "tensor"), 128)
    assert split.forward < one.forward
    assert split.memory["parameters"] == pytest.approx(one.memory["parameters"] / 2)
    assert split.comm_exposed > 0


def test_a_sharded_optimizer_holds_a_rank_count_share_of_the_state():
    machine, work = RoundMachine(cores=4), mlp_work()
    whole = predict(machine, work, Layout(4, 1, "data"), 128, "adam")
    shard = predict(machine, work, Layout(4, 1, "data"), 128, "adam", shard_optimizer=True)
    assert shard.memory["optimizer"] == pytest.approx(whole.memory["optimizer"] / 4)
    assert whole.memory["optimizer"] == 2 * 4 * work.params


def test_a_text_models_rate_is_in_tokens():
    from xpnn.nn.gpt import gpt

    work = model_work(
        gpt(65, layers=2, heads=4, embed=64, block=32), (32,), get_backend("numpy", "float32")
    )
    assert work.tokens_per_sample == 32
    heads = [g for g in work.gemms() if g.scales == "count"]
    assert {(g.m, g.k, g.n, g.count) for g in heads if g.phase == FORWARD} == {
        (32, 16, 32, 4),
        (32, 32, 16, 4),
    }
    p = predict(RoundMachine(), work, Layout(1, 1), 16)
    assert p.rate == pytest.approx(16 * 32 / p.step)


def test_the_layouts_offered_are_the_ones_the_strategies_accept():
    from xpnn.planner.auto import layouts

    mlp_layouts = layouts(mlp_work(), cores=2, max_ranks=2, batch=128)
    cnn_layouts = layouts(
        model_work(cnn(), (1, 28, 28), get_backend("numpy", "float32")), 2, 2, 128
    )
    assert any(x.parallel == "tensor" for x in mlp_layouts)
    assert not any(x.parallel == "tensor" for x in cnn_layouts)  # convolutions do not split
    narrow = layouts(mlp_work((1, 1)), cores=2, max_ranks=2, batch=128)
    assert not any(x.parallel == "tensor" for x in narrow)  # a unit per rank at least
    for x in mlp_layouts:  # never more threads than cores, batch threads dividing them
        assert x.ranks * x.threads <= 2 and x.threads % x.batch_threads == 0


def test_the_rest_measured_on_the_model_prices_its_passes_per_sample():
    from xpnn.planner.cost import compute_times
    from xpnn.planner.work import measure_rest

    machine, work = RoundMachine(), mlp_work((64,))
    bandwidth = compute_times(machine, work, 32, 1, "float32")["elementwise"]
    assert bandwidth == pytest.approx(work.elementwise() * 32 / 1e9)
    work.rest[1] = 2e-6
    assert compute_times(machine, work, 32, 1, "float32")["elementwise"] == pytest.approx(64e-6)
    work.rest_per_step[1] = 1e-4  # a step's own part: the same at any batch
    assert compute_times(machine, work, 32, 1, "float32")["elementwise"] == pytest.approx(164e-6)
    assert compute_times(machine, work, 64, 1, "float32")["elementwise"] == pytest.approx(228e-6)
    built = mlp((64,)).build((1, 28, 28), get_backend("numpy", "float32"), 0)
    fixed, per_sample = measure_rest(machine, work, built, 10, 1, "float32", batches=(8, 32))
    assert fixed >= 0.0 and per_sample >= 0.0
    assert fixed + 32 * per_sample < 1.0  # a step of 32 samples takes well under a second


def test_the_rest_is_a_cost_per_step_and_one_per_sample_through_two_batches():
    from xpnn.planner.work import fit_rest

    # 2 ms + 0.1 ms a sample: 5.2 ms at 32, 14.8 ms at 128
    assert fit_rest([(32, 5.2e-3), (128, 14.8e-3)]) == pytest.approx((2e-3, 1e-4))
    assert fit_rest([(128, 14.8e-3), (32, 5.2e-3)]) == pytest.approx((2e-3, 1e-4))
    assert fit_rest([(32, 4e-3), (128, 3e-3)]) == pytest.approx((3e-3, 0.0))  # shrinks: a step's
    assert fit_rest([(32, 1e-3), (128, 8e-3)]) == pytest.approx((0.0, 8e-3 / 128))  # through 0
    assert fit_rest([(32, -1e-3), (128, -1e-3)]) == (0.0, 0.0)  # products timed above the step


def test_a_node_shared_sum_is_a_fence_per_bucket_and_a_pass_over_the_rows():
    """mpi-shm sharing gradients: no message; each rank sums the node's rows of its share and
    updates that share; the ranks fence once per bucket and once at the end."""
    from xpnn.planner.cost import param_buckets

    machine, work = RoundMachine(cores=2), model_work(cnn(), (1, 28, 28), get_backend("numpy"))
    p = predict(machine, work, Layout(2, 1, "data", comm="auto"), 128, "sgd")
    # the update's own cut: 101,110 + 257,000 + 295,168 + 37,312 values
    assert param_buckets(work) == 4
    assert p.syncs == 4 + 1
    barrier = 1e-6 + 1e-9 * 4  # the round machine's allreduce of one value
    assert p.comm_exposed + p.comm_hidden == pytest.approx(5 * barrier)
    half = work.params / 2
    assert p.optimizer == pytest.approx(3 * half / 1e9 + (2 - 1) * half / 1e9)
    assert p.sync_wait == 0.0  # two ranks on two cores wait for no one's turn


def test_an_mlp_at_a_small_batch_shares_activations_with_two_fences_a_layer_past_the_first():
    machine, work = RoundMachine(cores=2), mlp_work()
    # 128 x (784+512 + 512+256 + 256+10) = 298,240 values < 535,818 parameters: activations
    p = predict(machine, work, Layout(2, 1, "data", comm="auto"), 128, "sgd")
    assert p.syncs == 2 + 1 + 2 * 2  # buckets, the end, 2 x (3 Dense - 1): 7, as a run counts
    assert p.optimizer == pytest.approx(3 * work.params / 2 / 1e9)  # no rows to sum
    big = predict(machine, work, Layout(2, 1, "data", comm="auto"), 512, "sgd")
    assert big.syncs == 3  # 4 x 298,240 > 535,818: gradients shared
    told = predict(machine, work, Layout(2, 1, "data", comm="auto"), 128, node_share="gradients")
    assert told.syncs == 3


def phase_machine() -> Machine:
    """2 cores; 4 and 8 one-thread ranks crowded 2 and 4 times; their phases between two
    fences measured at 0.1 and 1 ms of products alone."""
    return Machine(
        {"cores": 2},
        crowding={"4": 2.0, "8": 4.0},
        phases={"4": [[1e-4, 1.2e-3], [1e-3, 3.5e-3]], "8": [[1e-4, 3.4e-3], [1e-3, 9e-3]]},
        measured=False,
    )


def test_a_synchronization_of_crowded_ranks_costs_the_measured_phase_beyond_its_products():
    machine = phase_machine()
    assert machine.sync_wait(2, 1e-3) == 0.0  # two ranks on two cores wait for no one's turn
    # 4 ranks: 1.2 ms - 2 x 0.1 ms at 0.1 ms of products, 3.5 ms - 2 x 1 ms at 1 ms
    assert machine.sync_wait(4, 1e-4) == pytest.approx(1.0e-3)
    assert machine.sync_wait(4, 1e-3) == pytest.approx(1.5e-3)
    assert machine.sync_wait(4, 5.5e-4) == pytest.approx(1.25e-3)  # halfway between
    assert machine.sync_wait(4, 1e-6) == pytest.approx(1.0e-3)  # outside: the nearest end
    assert machine.sync_wait(4, 1.0) == pytest.approx(1.5e-3)
    assert machine.sync_wait(8, 1e-3) == pytest.approx(9e-3 - 4 * 1e-3)
    # 5 ranks, not measured: the nearest count's, per thread beyond the cores (3 against 2)
    assert machine.sync_wait(5, 1e-4) == pytest.approx(1.5 * 1.0e-3)
    machine.phases["4"].reverse()  # a file's points in any order
    assert machine.sync_wait(4, 5.5e-4) == pytest.approx(1.25e-3)


def test_without_phases_a_synchronization_costs_the_fence_measured_with_every_rank_at_once():
    from xpnn.runtime.stall import SPIN_S

    machine = Machine({"cores": 2}, measured=False)
    # nothing measured: each group of 2 ranks spins SPIN_S (0.5 ms) before the next gets on
    assert machine.sync_wait(8, 1e-3) == pytest.approx(4 * SPIN_S) == pytest.approx(2e-3)
    machine.shared = {"8": [2.5e-3, 1e-10]}
    assert machine.sync_wait(8, 1e-3) == pytest.approx(2.5e-3)


def test_each_synchronization_of_oversubscribed_ranks_pays_its_phase():
    machine, work = RoundMachine(cores=2), mlp_work()
    extra = lambda w: 1e-3 + 0.5 * w  # noqa: E731  the same line at every phase
    machine.phases = {"8": [[w, 4.0 * w + extra(w)] for w in (1e-6, 1.0)]}
    p = predict(machine, work, Layout(8, 1, "data", comm="auto"), 128, "sgd")
    alone = (p.forward + p.wgrad + p.dgrad + p.elementwise + p.optimizer) / p.slowdown
    assert p.slowdown == 4.0
    assert p.syncs == 7
    assert p.sync_wait == pytest.approx(7 * 1e-3 + 0.5 * alone)  # 7 phases of alone / 7
    assert p.comm_exposed == 0.0  # a crowded fence is all in its wait, not priced twice
    assert p.step == pytest.approx(
        p.forward + p.wgrad + p.dgrad + p.elementwise + p.optimizer + p.comm_exposed + p.sync_wait
    )


def test_across_nodes_the_gradients_cross_the_network_as_a_ring_allreduce():
    machine, work = RoundMachine(cores=2), mlp_work()
    machine.network = {"alpha": 1e-5, "beta": 1e-9}
    grads = 4 * work.params  # one bucket of 4 MiB holds them
    # mpi-host: the node's allreduce (round machine) then the ring over 2 nodes
    host = predict(machine, work, Layout(4, 1, "data", comm="mpi-host", nodes=2), 128, "sgd")
    ring = 2 * (2 - 1) * 1e-5 + 2 * (2 - 1) / 2 * grads * 1e-9
    assert host.comm_exposed + host.comm_hidden == pytest.approx(1e-6 + 1e-9 * grads + ring)
    # node-shared over 4 nodes: gradients shared on each node; each rank's share crosses
    shm = predict(machine, work, Layout(8, 1, "data", comm="auto", nodes=4), 128, "sgd")
    assert shm.syncs == 2 + 1  # across nodes a run shares gradients
    cross = 2 * 2 * (4 - 1) * 1e-5 + 2 * (4 - 1) / 4 * grads * 1e-9  # 2 buckets' latencies
    assert shm.comm_exposed + shm.comm_hidden == pytest.approx(3 * (1e-6 + 4e-9) + cross)
    assert shm.slowdown == 1.0  # 2 ranks a node on its 2 cores


def test_a_calibration_without_a_network_prices_the_stated_default():
    from xpnn.planner.cost import network_allreduce
    from xpnn.planner.machine import DEFAULT_NETWORK

    machine = RoundMachine()
    assert not machine.network_measured
    alpha, beta = DEFAULT_NETWORK
    assert network_allreduce(machine, 2, 1e6) == pytest.approx(2 * alpha + 1e6 * beta)
    assert network_allreduce(machine, 1, 1e6) == 0.0


def test_explain_names_the_oversubscribed_ranks_waits_at_each_synchronization():
    from xpnn.commands.plan import verdict

    machine, work = RoundMachine(cores=2), mlp_work()
    p = predict(machine, work, Layout(8, 1, "data", comm="auto"), 128)
    line = verdict(2 * p.step, p, None, cores=2)
    assert "8 threads on 2 cores" in line and f"each of a step's {p.syncs} synchronizations" in line
    assert f"({1e3 * p.sync_wait:.1f} ms predicted)" in line


def test_auto_is_priced_as_the_transport_the_backend_takes():
    from types import SimpleNamespace

    from xpnn.planner.work import as_run

    layout = Layout(2, 1, "data", comm="auto")
    assert as_run(SimpleNamespace(backend="numba"), layout).node_shared
    assert as_run(SimpleNamespace(backend="auto"), layout).node_shared
    assert as_run(SimpleNamespace(backend="torch"), layout).comm == "mpi-host"
    assert not as_run(SimpleNamespace(backend="torch"), layout).node_shared


def test_a_flatten_is_a_view_and_moves_no_values():
    """A pipeline stage's share of the measured rest follows the values its layers move."""
    work = mlp_work()
    assert "Flatten" in work.layers[0].name and work.layers[0].elementwise == 0
    assert work.elementwise() == 3 * (512 + 256 + 10)  # each Dense: z, bias, activation


def test_tensor_parallelism_sums_each_pairs_outer_widths_and_keeps_a_left_over_layer_whole():
    from xpnn.planner.cost import tensor_allreduces

    work = mlp_work((512, 256, 128))  # pairs 784 -> 512 -> 256 and 256 -> 128 -> 10
    # forward: each row-split layer's outputs; backward: the second column-split layer's
    # 256 inputs (the first layer's input gradient is never needed)
    assert tensor_allreduces(work, 128, 4) == [128 * 256 * 4, 128 * 10 * 4, 128 * 256 * 4]
    machine, work = RoundMachine(cores=2), mlp_work()  # 784 -> 512 -> 256 paired, -> 10 whole
    p = predict(machine, work, Layout(2, 1, "tensor"), 128, "sgd")
    flops = 2 * 128 * (784 * 256 + 512 * 128 + 256 * 10)  # halves of the pair, all of the last
    assert p.forward == pytest.approx(flops / FLOPS)
    assert p.syncs == 1
