"""2-D parallelism: replicas of a tensor- or pipeline-parallel network, trained data-parallel.

The grid is checked as arithmetic, and 4 real ranks (2 replicas x 2 ranks, on this 2-core
machine oversubscribed, which costs time, not correctness) against one process: the same
seed and global batch give the same parameters, metrics and checkpoints.
"""

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import (
    CNN_DROPOUT_RUN,
    ROOT,
    TINY_FLOAT64_RUN,
    assert_failing_rank_stops_the_job,
    assert_one_line_user_error,
    mpiexec_path,
    run_xpnn,
    train_and_load,
)

from xpnn.errors import UserError
from xpnn.parallel.comm import SelfCommunicator
from xpnn.parallel.plan import Groups, Place, Plan
from xpnn.run import RunSpec, resolve


def place_of(rank: int, size: int, parallel: str, model_ranks: int | None) -> Place:
    """Rank ``rank``'s place in the plan of ``size`` ranks under ``parallel``."""
    spec, _ = resolve(RunSpec(parallel=parallel, model_ranks=model_ranks))
    world = SimpleNamespace(rank=rank, size=size, local_size=size)
    return Plan.build(spec, world).place(rank)


@pytest.mark.parametrize(
    "rank, size, parallel, k, want",
    [
        (3, 4, "data", None, Place(1, 4, 0, 3)),  # every rank is a replica
        (3, 4, "data", 2, Place(1, 4, 0, 3)),  # --model-ranks means nothing here
        (3, 4, "tensor", None, Place(4, 1, 3, 0)),  # all ranks hold one replica
        (3, 4, "tensor", 2, Place(2, 2, 1, 1)),
        (2, 4, "pipeline", 2, Place(2, 2, 0, 1)),  # a replica's ranks are consecutive
        (4, 6, "pipeline", 3, Place(3, 2, 1, 1)),
        (5, 6, "tensor", 1, Place(1, 6, 0, 5)),  # replicas of one rank: data parallelism
    ],
)
def test_each_rank_has_one_place_in_the_grid(rank, size, parallel, k, want):
    assert place_of(rank, size, parallel, k) == want


def test_the_grid_covers_every_place_once():
    places = [place_of(r, 6, "tensor", 3) for r in range(6)]
    assert sorted((p.replica, p.index) for p in places) == [
        (r, i) for r in range(2) for i in range(3)
    ]


@pytest.mark.parametrize(
    "size, k, message",
    [
        (4, 3, "`model_ranks` 3: 4 ranks do not split into replicas of 3 ranks"),
        (4, 8, "`model_ranks` 8: more than the job's 4 rank(s)"),
    ],
)
def test_a_grid_that_does_not_fit_is_a_user_error(size, k, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        place_of(0, size, "tensor", k)


def test_the_one_dimensional_layouts_name_one_transport():
    alone = SelfCommunicator()
    data = Groups.of(alone)
    assert data.data is alone and data.model.size == 1 and data.name == "self"
    tensor = Groups.of(alone, spread=True)
    assert tensor.model is alone and tensor.data.size == 1
    assert Groups.of(alone, spread=True).fallback_reason is None
    # an explicit --comm on one rank (mpiexec -n 1) is named, not hidden behind "self"
    one_rank = SimpleNamespace(name="mpi-host", size=1, fallback_reason=None)
    assert Groups.of(one_rank).name == Groups.of(one_rank, spread=True).name == "mpi-host"


# -- real mpiexec: 2 replicas x 2 ranks ---------------------------------------------------------
MLP = [*TINY_FLOAT64_RUN, "--hidden", "96,700,64"]  # two split pairs (tensor), 4 Dense layers


@pytest.mark.parametrize(
    "base, layout, comm",
    [
        (MLP, ["--parallel", "tensor", "--model-ranks", "2"], "mpi-host (model) + mpi-shm (data)"),
        (
            MLP,
            ["--parallel", "tensor", "--model-ranks", "2", "--comm", "mpi-host"],
            "mpi-host (model) + mpi-host (data)",
        ),
        (
            MLP,
            ["--parallel", "pipeline", "--model-ranks", "2", "--microbatches", "3"],
            "mpi-host (model) + mpi-shm (data)",
        ),
        (
            CNN_DROPOUT_RUN,
            ["--parallel", "pipeline", "--model-ranks", "2", "--pipeline-schedule", "1f1b"],
            "mpi-host (model) + mpi-shm (data)",
        ),
        (MLP, ["--parallel", "tensor", "--model-ranks", "1"], "mpi-shm"),  # replicas of 1 rank
    ],
    ids=["tensor-shm", "tensor-host", "pipeline-gpipe", "cnn-pipeline-1f1b", "tensor-k1"],
)
def test_replicas_of_a_spread_network_compute_the_one_rank_run(tmp_path, base, layout, comm):
    """Global batch 70 (MLP) or 30 (CNN, with dropout): 35 or 15 samples per replica, cut
    again into micro-batches under pipelines; the gradients of the replicas are summed over
    the data group, the metrics counted once per sample."""
    one, rec1, _ = train_and_load(tmp_path, 1, base)
    got, rec, proc = train_and_load(tmp_path, 4, [*base, *layout])
    assert list(got) == list(one)  # the whole network, under the 1-rank names, in order
    for name in one:
        scale = np.abs(one[name]).max()
        np.testing.assert_allclose(got[name], one[name], rtol=0, atol=1e-10 * scale, err_msg=name)
    done = rec[-1]
    assert done["world_size"] == 4 and done["comm"] == comm
    if "(data)" in comm:  # the same two names, each on its own key
        assert comm == f"{done['model_comm']} (model) + {done['data_comm']} (data)"
    else:
        assert done["model_comm"] == "self" and done["data_comm"] == comm
    k = int(layout[layout.index("--model-ranks") + 1])
    assert done["model_ranks"] == k and done["replicas"] == 4 // k
    assert done["ranks_agree"] and done["params"] == rec1[-1]["params"]
    assert done["global_batch"] == rec1[-1]["global_batch"]
    assert len(done["peak_rss_mb"]) == 4 and min(done["peak_rss_mb"]) > 20  # MiB, by rank
    for r1, r in zip(rec1[:2], rec[:2], strict=True):
        assert r["train_loss"] == pytest.approx(r1["train_loss"], rel=1e-10)
        assert r["test_loss"] == pytest.approx(r1["test_loss"], rel=1e-10)
        assert r["train_acc"] == r1["train_acc"] and r["test_acc"] == r1["test_acc"]
    if k > 1:
        assert f"over {k} ranks x {4 // k} replicas" in proc.stdout
    assert rec1[1]["train_loss"] < rec1[0]["train_loss"]  # it trained: equality is not trivial


def test_replicas_on_pretend_nodes_share_memory_within_each(tmp_path):
    """6 ranks as 3 pretend nodes of 2 (XPNN_RANKS_PER_NODE), 3 replicas of 2: each data group
    ({0, 2, 4}, {1, 3, 5}) has one rank per node, so mpi-shm's cross-node allreduce runs. The
    pretend nodes are cut by the rank in the job, not in the group (a group of 3 on one
    machine was once cut as nodes of 2 and 1, and refused)."""
    one, _, _ = train_and_load(tmp_path, 1, MLP)
    layout = ["--parallel", "tensor", "--model-ranks", "2", "--comm", "mpi-shm"]
    env = {"XPNN_RANKS_PER_NODE": "2"}
    saved, metrics = tmp_path / "six.npz", tmp_path / "six.jsonl"
    args = [*MLP, *layout, "--save", str(saved), "--metrics", str(metrics)]
    proc = run_xpnn(args, ranks=6, env=env)
    assert proc.returncode == 0, proc.stderr
    done = json.loads(metrics.read_text().splitlines()[-1])
    assert done["data_comm"] == "mpi-shm" and done["replicas"] == 3 and done["ranks_agree"]
    with np.load(saved) as got:
        for name, want in one.items():
            scale = np.abs(want).max()
            np.testing.assert_allclose(got[name], want, rtol=0, atol=1e-10 * scale, err_msg=name)


def test_per_rank_batch_and_linear_lr_count_replicas_not_ranks(tmp_path):
    i = MLP.index("--batch-size")
    per_replica = [*MLP[:i], *MLP[i + 2 :], "--per-rank-batch", "35", "--lr-scaling", "linear"]
    _, rec, proc = train_and_load(
        tmp_path, 4, [*per_replica, "--parallel", "tensor", "--model-ranks", "2"]
    )
    assert rec[-1]["global_batch"] == 70
    assert "global batch 70, adam lr 0.02" in proc.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model-ranks", "3"], "--model-ranks 3: 4 ranks do not split into replicas of 3"),
        (["--model-ranks", "8"], "--model-ranks 8: more than the job's 4 rank(s)"),
        (["--model-ranks", "0"], "--model-ranks: must be at least 1, got 0"),
        (["--model-ranks", "2", "--hidden", "1,8"], "a layer of 1 units cannot be split over 2"),
    ],
)
def test_a_grid_that_does_not_fit_is_one_line_exit_2(args, message):
    proc = run_xpnn([*MLP, "--parallel", "tensor", "--epochs", "1", *args], ranks=4, timeout=120)
    assert_one_line_user_error(proc, message)


def test_model_ranks_under_data_parallelism_says_it_has_no_effect():
    proc = run_xpnn([*TINY_FLOAT64_RUN, "--hidden", "8", "--epochs", "1", "--model-ranks", "2"])
    assert proc.returncode == 0, proc.stderr
    assert "--model-ranks has no effect with --parallel data" in proc.stderr


def test_one_failing_rank_stops_a_two_dimensional_job():
    """Rank 3 (replica 1, second stage) raises at step 3; the others wait for it in the
    pipeline's messages and the data group's fences."""
    args = [*MLP, "--parallel", "pipeline", "--model-ranks", "2", "--epochs", "50"]
    assert_failing_rank_stops_the_job(args, ranks=4, rank=3)


GROUPS_SCRIPT = """
import json, sys
from pathlib import Path
from types import SimpleNamespace
import numpy as np
from xpnn.runtime import init_world
from xpnn.parallel.plan import Plan
from xpnn.run import RunSpec, resolve

w = init_world()
plan = Plan.build(resolve(RunSpec(parallel="pipeline", model_ranks=2))[0], w)
place = plan.place(w.rank)
cpu = SimpleNamespace(name="numpy", is_gpu=False, xp=np)
g = plan.groups(w, cpu)
sub = w.split(place.replica)
Path(sys.argv[1], f"{w.rank}.json").write_text(json.dumps({
    "rank": w.rank,
    "model": g.model.allgather_obj(w.rank),
    "data": g.data.allgather_obj(w.rank),
    "world": g.world.allgather_obj(w.rank),
    "names": [g.model.name, g.data.name],
    "speaks": sub.is_root,
    "bcast": g.model.bcast_obj(f"from {w.rank}", root=1),
    "gathered": w.allgather_obj(w.rank, "the test's gathering"),
}))
"""


def test_each_rank_talks_to_its_replica_and_to_its_place_in_the_others(tmp_path):
    script = tmp_path / "groups.py"
    script.write_text(GROUPS_SCRIPT)
    proc = subprocess.run(
        [mpiexec_path(), "-n", "4", sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    seen = {r["rank"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob("?.json"))}
    assert sorted(seen) == [0, 1, 2, 3]
    for rank, r in seen.items():
        assert r["model"] == [0, 1] if rank < 2 else r["model"] == [2, 3]
        assert r["bcast"] == ("from 1" if rank < 2 else "from 3")  # root 1 of each replica
        assert r["gathered"] == [0, 1, 2, 3]
        assert r["data"] == [0, 2] if rank % 2 == 0 else r["data"] == [1, 3]
        assert r["world"] == [0, 1, 2, 3]
        assert r["names"] == ["mpi-host", "mpi-shm"]
        assert r["speaks"] == (rank == 0)  # rank 2 leads its replica, not the job
