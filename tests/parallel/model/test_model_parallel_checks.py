"""Tensor and pipeline parallelism as a demanding user drives them: what they are told about
settings that run, but not as given."""

import pytest
from conftest import run_xpnn

SMALL = [
    "--dataset", "synthetic", "--synthetic-size", "100", "--batch-size", "50", "--epochs", "1",
    "--hidden", "8", "--no-progress", "--threads", "1", "--parallel", "pipeline",
    "--backend", "numpy",
]  # fmt: skip


@pytest.mark.parametrize(
    "layout, microbatches, said",
    [
        (["--model-ranks", "1"], 26, "the 25 sample(s) of each replica's share of a batch"),
        ([], 51, "the 50 sample(s) of a batch"),
        ([], 50, None),  # one micro-batch per sample: as asked
    ],
)
def test_more_microbatches_than_samples_is_said_once(layout, microbatches, said):
    """A batch is cut into at most one micro-batch per sample, so ``--microbatches`` above a
    replica's share of the batch ran fewer micro-batches than the summary line and the
    metrics say, without a word; now a note says so, once."""
    args = [*SMALL, *layout, "--microbatches", str(microbatches)]
    proc = run_xpnn(args, ranks=2, timeout=120)
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "--microbatches" in line]
    if said is None:
        assert notes == [], proc.stderr
    else:
        assert notes == [
            f"xpnn: note: --microbatches {microbatches} is more than {said}: a step runs at "
            f"most {said.split()[1]} micro-batch(es), of one sample each"
        ], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "extra, said",
    [
        (["--microbatches", "1"], True),
        (["--batch-size", "1", "--synthetic-size", "8"], True),  # one sample: one micro-batch
        ([], False),  # 4 micro-batches: the first three are computed again
    ],
)
def test_recompute_with_one_microbatch_is_said(extra, said):
    """With one micro-batch a step, its activations are still in the layers at its backward
    pass, so --recompute computed nothing again, and the run line said "recompute"."""
    proc = run_xpnn([*SMALL, "--recompute", *extra], ranks=2, timeout=120)
    assert proc.returncode == 0, proc.stderr
    notes = [line for line in proc.stderr.splitlines() if "--recompute" in line]
    expected = (
        "xpnn: note: --recompute has no effect with one micro-batch a step: its activations "
        "are still held when its backward pass comes, so none are computed again"
    )
    assert notes == ([expected] if said else []), proc.stderr


def test_too_many_stages_names_the_ranks_of_a_replica():
    """Under --model-ranks "use fewer ranks" would be wrong advice: 6 ranks in 2 replicas of 3
    fail for a 2-layer model just as 3 ranks do; the ranks of a replica are what count."""
    proc = run_xpnn([*SMALL, "--model-ranks", "3"], ranks=3, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "xpnn: --parallel pipeline: 3 stages (a replica's ranks) but the model has only 2 "
        "layers with parameters (one stage each at most); use at most 2 ranks a replica "
        "(fewer ranks, or --model-ranks) or --parallel data"
    )
