"""Tensor and pipeline parallelism as a demanding user drives them: what they are told about
settings that run, but not as given."""

import pytest
from conftest import run_xpnn

SMALL = [
    "--dataset", "synthetic", "--synthetic-size", "100", "--batch-size", "50", "--epochs", "1",
    "--hidden", "8", "--no-progress", "--threads", "1", "--parallel", "pipeline",
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
