"""``--shard-optimizer`` (ZeRO stage 1) under real ``mpiexec``: 1 to 4 ranks train the same
parameters in float64, a checkpoint resumes on another rank count, and each rank keeps 1 / N
of the optimizer state."""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import (
    CNN_DROPOUT_RUN,
    TINY_FLOAT64_RUN,
    assert_one_line_user_error,
    run_xpnn,
    train_and_load,
)

from parallel.model.test_gpt_parallel import gpt_args, write_text
from xpnn.backends import get_backend
from xpnn.nn import build_model
from xpnn.parallel.update.sharded import ShardedUpdate, piece_counts, shard_bounds
from xpnn.train.optim import Schedule, make_optimizer

SHARD = ["--shard-optimizer"]
# two hidden layers and 10 KiB buckets: many buckets, cut inside every rank's shard
MLP = [*TINY_FLOAT64_RUN, "--hidden", "24,16", "--bucket-mb", "0.01"]


def assert_same(want: dict, got: dict) -> None:
    assert sorted(want) == sorted(got)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-9, atol=1e-12, err_msg=name)


def assert_sharded_runs_equal_one_rank(tmp_path, args, ranks=(2, 3), layout=()) -> list[dict]:
    """``args`` on 1 rank against ``ranks`` ranks sharding (with the flags ``layout``)."""
    one, rec1, _ = train_and_load(tmp_path, 1, [*args, *SHARD])
    assert rec1[-1]["update"] == "local"  # one rank: nothing to shard
    moved = train_and_load(tmp_path, 1, [*args, "--epochs", "1"])[0]
    assert any(not np.allclose(one[k], moved[k]) for k in one)  # training moved them
    records = []
    for n in ranks:
        params, rec, _ = train_and_load(tmp_path, n, [*args, *layout, *SHARD])
        assert rec[-1]["update"] == "sharded" and rec[-1]["ranks_agree"], rec[-1]
        plan = rec[-1]["plan"]
        assert plan["shard_optimizer"] is True and plan["replicas"] == n // plan["model_ranks"]
        assert_same(one, params)
        records.append(rec[-1])
    return records


def test_the_mlp_on_one_to_four_ranks(tmp_path):
    assert_sharded_runs_equal_one_rank(tmp_path, MLP, ranks=(2, 3, 4))


@pytest.mark.parametrize("mode", ["tensor", "pipeline"])
def test_replicas_of_a_split_network_shard_their_pieces(tmp_path, mode):
    """2 replicas of 2 ranks: each rank's piece sharded over its place in the other replica,
    clipped by the whole model's norm (a tensor part's unsplit biases counted once)."""
    layout = ["--parallel", mode, "--model-ranks", "2"]
    args = [*MLP, "--clip-norm", "0.05"]
    [record] = assert_sharded_runs_equal_one_rank(tmp_path, args, ranks=(4,), layout=layout)
    assert record["plan"]["model_ranks"] == 2 and record["data_comm"] == "mpi-host"


def test_adamw_with_clipping_and_accumulation_on_three_ranks(tmp_path):
    """Weight decay on the shard's matrices only, the global norm from every shard, each
    batch in two micro-steps."""
    args = [*MLP, "--optimizer", "adamw", "--weight-decay", "0.1", "--clip-norm", "0.05"]
    args += ["--accumulate", "2"]
    assert_sharded_runs_equal_one_rank(tmp_path, args, ranks=(3,))


def test_the_cnn_on_one_to_four_ranks(tmp_path):
    args = [*CNN_DROPOUT_RUN, "--synthetic-size", "60"]
    assert_sharded_runs_equal_one_rank(tmp_path, args, ranks=(2, 3, 4))


def test_the_gpt_on_one_to_four_ranks(tmp_path):
    corpus = write_text(tmp_path / "corpus.txt")
    args = [*gpt_args(corpus), "--epochs", "2"]
    assert_sharded_runs_equal_one_rank(tmp_path, args, ranks=(2, 3, 4))


def test_a_checkpoint_resumes_on_another_rank_count(tmp_path):
    """Saved by 2 sharded ranks after epoch 1: 3 sharded ranks and 1 plain rank continue it
    into the run that never stopped; the file holds the whole state, shaped as the model."""
    whole, _, _ = train_and_load(tmp_path, 1, MLP)
    first = tmp_path / "first"
    train_and_load(tmp_path, 2, [*MLP, *SHARD, "--epochs", "1", "--checkpoint-dir", str(first)])
    [saved] = sorted(first.glob("*.npz"))
    with np.load(saved) as stored:
        for key in whole:
            assert stored[f"optim.m.{key}"].shape == whole[key].shape
            assert stored[f"optim.v.{key}"].any()  # every shard's state, not only rank 0's
    for ranks, extra in ((3, SHARD), (1, [])):
        again = tmp_path / f"again{ranks}"
        shutil.copytree(first, again)
        resume = ["--checkpoint-dir", str(again), "--resume"]
        params, records, proc = train_and_load(tmp_path, ranks, [*MLP, *extra, *resume])
        assert "resume:" in proc.stdout
        assert [r["epoch"] for r in records if "epoch" in r] == [2]  # epoch 2 alone
        assert_same(whole, params)


def test_a_split_networks_sharded_checkpoint_resumes_on_one_rank(tmp_path):
    """Written by 2 replicas of 2 tensor parts, each part's state in 2 shards: whole again."""
    whole, _, _ = train_and_load(tmp_path, 1, MLP)
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt")]
    layout = ["--parallel", "tensor", "--model-ranks", "2", *SHARD]
    train_and_load(tmp_path, 4, [*MLP, *layout, "--epochs", "1", *ckpt])
    params, _, proc = train_and_load(tmp_path, 1, [*MLP, *ckpt, "--resume"])
    assert "resume:" in proc.stdout
    assert_same(whole, params)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_each_rank_keeps_one_nth_of_the_optimizer_state(ranks):
    backend = get_backend("numpy", "float64")
    model = build_model("mlp", (64, 32)).build((20,), backend, 0)
    n = model.size
    sizes = []
    for rank in range(ranks):
        comm = SimpleNamespace(rank=rank, size=ranks)

        def optimizer(params, grads, parts=None, zeros=None, offset=0):
            return make_optimizer("adam", params, grads, backend.kernels, Schedule(0.1), parts)

        update = ShardedUpdate(model, comm, optimizer, 1 << 12)
        state = update.optimizer.inner.state
        assert sorted(state) == ["m", "v"]
        sizes.append(state["m"].size)
        assert all(buf.size == sizes[-1] for buf in state.values())
        assert sizes[-1] <= -(-n // ranks)  # 1 / N, rounded up
        assert update.optimizer.state["m"].shape == (n,)  # what a checkpoint loads into
    assert sum(sizes) == n and max(sizes) - min(sizes) <= 1


class Recorded:
    """A transfer's handle whose wait is written down."""

    def __init__(self, events: list, event: tuple) -> None:
        self.events, self.event = events, event

    def wait(self) -> None:
        self.events.append(("wait", *self.event))


class RecordingComm:
    """Rank ``rank`` of ``size``: every transfer posted and waited, in order; nothing sent."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.events, self.gathered = rank, size, [], []

    def _post(self, what: str) -> Recorded:
        event = (what, sum(e[:2] == ("post", what) for e in self.events))
        self.events.append(("post", *event))
        return Recorded(self.events, event)

    def ireduce_scatter_(self, buf, counts):
        return self._post("reduce-scatter")

    def iallgather_(self, buf, counts):
        self.gathered.append((buf.size, counts))
        return self._post("all-gather")


@pytest.mark.parametrize("rank", [0, 1])
def test_each_buckets_all_gather_starts_while_later_buckets_are_reduced(rank):
    """The parameters are gathered bucket by bucket, each started once its pieces are
    updated and before the later buckets' gradients are waited for, all done by the step's
    end: not one all-gather after every update."""
    backend = get_backend("numpy", "float64")
    model = build_model("mlp", (64, 32)).build((20,), backend, 0)
    comm = RecordingComm(rank, 2)

    def optimizer(params, grads, parts=None, zeros=None, offset=0):
        return make_optimizer("adam", params, grads, backend.kernels, Schedule(0.1), parts)

    update = ShardedUpdate(model, comm, optimizer, 1 << 12)
    bounds = update.buckets.bounds
    assert len(bounds) >= 6
    model.grads[...] = 1.0
    update.finish()
    events, last = comm.events, len(bounds) - 1
    assert comm.gathered == [(e - s, piece_counts(s, e, update.shards)) for s, e in bounds]
    posted = [e for e in events if e[:2] == ("post", "all-gather")]
    assert posted == [("post", "all-gather", b) for b in range(len(bounds))]  # bucket order
    first, final = events.index(posted[0]), events.index(("wait", "reduce-scatter", last))
    assert first < final  # overlapped with the later buckets' reductions and updates
    assert events.index(("wait", "reduce-scatter", 0)) < first  # after its own
    waited = [e for e in events if e[:2] == ("wait", "all-gather")]
    assert waited == [("wait", "all-gather", b) for b in range(len(bounds))]
    assert events[-1] == waited[-1]  # the step returns with the parameters whole


def test_shards_cover_the_buffer_in_rank_order():
    assert shard_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]  # a rank may hold nothing


def test_the_flag_is_in_the_metrics_plan(tmp_path):
    _, records, proc = train_and_load(tmp_path, 2, [*MLP, *SHARD, "--epochs", "1"])
    assert "plan: 2 replicas x 1 stage x 1 part, sharded over mpi-host" in proc.stdout
    assert json.loads(json.dumps(records[-1]["plan"]))["update"] == "sharded"


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--comm", "mpi-shm"], "--shard-optimizer: not with node-shared memory (--comm mpi-shm"),
        (["--precision", "bf16"], "--shard-optimizer: not with --precision bf16"),
        (["--grad-dtype", "float16"], "--shard-optimizer: not with --grad-dtype float16"),
    ],
)
def test_a_combination_it_does_not_support_is_one_line(flags, said):
    proc = run_xpnn([*MLP, *SHARD, *flags], ranks=2, timeout=120)
    assert_one_line_user_error(proc, said)


def test_one_rank_is_told_there_is_nothing_to_shard():
    proc = run_xpnn([*MLP, *SHARD, "--epochs", "1"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    note = "xpnn: note: --shard-optimizer has no effect with one data-parallel rank"
    assert note in proc.stderr


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_a_step_sends_no_more_bytes_than_the_allreduce(tmp_path, ranks):
    """Reduce-scattered buckets and one all-gather: the counted bytes of a step are at most
    the allreduce's (an allreduce followed by the shards' broadcasts would send the parameters
    once more)."""
    args = [*MLP, "--epochs", "1", "--comm", "mpi-host"]
    plain, sharded = (
        next(r for r in train_and_load(tmp_path, ranks, run)[1] if r.get("event") == "epoch")
        for run in (args, [*args, *SHARD])
    )
    assert plain["update"] == "allreduce" and sharded["update"] == "sharded"
    assert plain["comm"] == sharded["comm"] == "mpi-host"
    model_bytes = 8 * sum(v.size for v in train_and_load(tmp_path, 1, MLP)[0].values())
    assert plain["comm_bytes_per_step"] >= ranks * model_bytes  # each rank its gradient
    assert 0 < sharded["comm_bytes_per_step"] <= plain["comm_bytes_per_step"]
