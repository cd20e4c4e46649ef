"""Tensor and pipeline parallelism over several nodes, priced against hand-computed cases on
the round machine with a network of 10 us + 1 ns a byte."""

from __future__ import annotations

import pytest

from tests.planner.test_cost_model import RoundMachine, mlp_work
from xpnn.planner.auto import node_layouts, tensor_fits
from xpnn.planner.cost import Layout, predict

NET_ALPHA, NET_BETA = 1e-5, 1e-9


def networked() -> RoundMachine:
    machine = RoundMachine(cores=2)
    machine.network = {"alpha": NET_ALPHA, "beta": NET_BETA}
    return machine


def test_tensor_parts_over_nodes_add_the_networks_ring_to_each_activation_allreduce():
    machine, work = networked(), mlp_work()
    p = predict(machine, work, Layout(4, 1, "tensor", nodes=2), 128, "sgd")
    # one pair (784 -> 512 -> 256): the row-split layer's 256 outputs summed forward; the
    # column-split one is the first layer, whose input gradient nothing needs
    act = 128 * 256 * 4
    here = 1e-6 + 1e-9 * act  # the node's 2 ranks (the round machine's allreduce)
    ring = 2 * (2 - 1) * NET_ALPHA + 2 * (2 - 1) / 2 * act * NET_BETA
    assert p.syncs == 1
    assert p.comm_exposed == pytest.approx(here + ring)


def test_a_pipeline_over_nodes_sends_across_the_network_at_the_nodes_boundaries():
    machine, work = networked(), mlp_work()
    # one stage a node: its one boundary crosses the network
    p = predict(machine, work, Layout(2, 2, "pipeline", 1, 4, "gpipe", "mpi-host", 2), 128, "sgd")
    act = 32 * 512 * 4  # a micro-batch of 32 samples' widest activation
    assert p.comm_exposed == pytest.approx(2 * (4 + 2 - 1) * (NET_ALPHA + NET_BETA * act))
    # two stages a node over 2 nodes: of 3 boundaries, 1 crosses
    p = predict(machine, work, Layout(4, 1, "pipeline", 1, 4, "gpipe", "mpi-host", 2), 128, "sgd")
    here, net = 1e-6 + 1e-9 * act, NET_ALPHA + NET_BETA * act
    assert p.comm_exposed == pytest.approx(2 * (4 + 4 - 1) * (2 * here + net) / 3)


def test_plan_over_nodes_lists_tensor_and_pipeline_beside_data():
    work = mlp_work()  # 3 Dense layers: a pipeline of up to 3 stages
    found = node_layouts(2, 2, 8, 128, work)
    assert all(layout.nodes == 2 for layout in found)
    kinds = {(layout.parallel, layout.ranks) for layout in found}
    assert {("data", 2), ("data", 4), ("pipeline", 2)} <= kinds
    assert ("pipeline", 4) not in kinds  # more stages than layers with parameters
    assert (("tensor", 2) in kinds) == tensor_fits(work, 2)
    assert (("tensor", 4) in kinds) == tensor_fits(work, 4)
    pipelines = [x for x in found if x.parallel == "pipeline"]
    assert {(x.microbatches, x.schedule) for x in pipelines} == {
        (m, s) for m in (2, 4, 8) for s in ("gpipe", "1f1b")
    }
    assert all(layout.parallel == "data" for layout in node_layouts(2, 2, 8, 128))
