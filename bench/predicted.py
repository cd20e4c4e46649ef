"""What the planner predicts for a recorded training run: the same flags (the record's own
command line), ranks and threads priced by ``xpnn plan``'s cost model, so each study's figure
and table can set the prediction beside the measurement.

A record's prediction is ``r["predicted"]``: the step, the steps of one epoch (the training
samples over the global batch, rounded up), an epoch and the whole training; or, where the
planner cannot price the run, ``{"none": reason}``.
"""

from __future__ import annotations

import math
import shlex
from typing import Any

from xpnn.commands import predict_run
from xpnn.errors import UserError
from xpnn.planner import Layout

LABEL = "predicted (xpnn plan)"
NO_GPU = "no prediction: no GPU calibration"
MNIST_SAMPLES = 60_000


def run_of(config: dict[str, Any]) -> tuple[list[str], Layout, int]:
    """(xpnn's flags, the layout, the training samples) of the run ``config`` recorded."""
    words = shlex.split(config["command"])
    ranks = int(words[words.index("-n") + 1]) if words[0].endswith("mpiexec") else 1
    flags = words[words.index("xpnn") + 1 :]
    if "--metrics" in flags:
        i = flags.index("--metrics")
        del flags[i : i + 2]
    samples = int(config.get("train_samples") or _samples(flags))
    _set(flags, "--batch-size", lambda b: str(samples) if b == "full" else b)
    if "--per-rank-batch" in flags:  # the planner takes the global batch
        i = flags.index("--per-rank-batch")
        flags[i : i + 2] = ["--batch-size", str(int(flags[i + 1]) * ranks)]
    layout = Layout(
        ranks=ranks,
        threads=int(_get(flags, "--threads", "1")),
        parallel=_get(flags, "--parallel", "data") if ranks > 1 else "data",
        batch_threads=int(_get(flags, "--batch-threads", "1")),
        microbatches=int(_get(flags, "--microbatches", "1")),
        schedule=_get(flags, "--pipeline-schedule", "gpipe"),
        comm=_get(flags, "--comm", "auto"),  # a run's default: node-shared memory on the CPU
    )
    return flags, layout, samples


def _get(flags: list[str], name: str, default: str) -> str:
    return flags[flags.index(name) + 1] if name in flags else default


def _set(flags: list[str], name: str, change: Any) -> None:
    if name in flags:
        i = flags.index(name) + 1
        flags[i] = change(flags[i])


def _samples(flags: list[str]) -> int:
    """The training samples a command reads: the synthetic set's size, else MNIST's 60,000,
    times its copies."""
    one = int(_get(flags, "--synthetic-size", "0")) or MNIST_SAMPLES
    return one * int(_get(flags, "--replicate", "1"))


def predict_record(config: dict[str, Any], calibration: str | None = None) -> dict[str, Any]:
    """The planner's prediction for the run ``config`` describes (see the module's text)."""
    flags, layout, samples = run_of(config)
    if "--recompute" in flags:
        return {"none": "the planner does not model --recompute"}
    try:
        pred, batch = predict_run(flags, layout, calibration)
    except UserError as exc:
        return {"none": str(exc)}
    steps = math.ceil(samples / batch)
    epochs = int(_get(flags, "--epochs", "1"))
    return {
        "step_s": pred.step,
        "steps_per_epoch": steps,
        "epoch_s": steps * pred.step,
        "train_s": epochs * steps * pred.step,
        "largest": pred.largest(),
        "calibration": calibration or "this machine's (cached)",
    }


def annotate(records: list[dict[str, Any]], calibration: str | None = None) -> None:
    """Each training record's prediction into ``r["predicted"]`` (records of other studies,
    which name no xpnn command, are left as they are)."""
    for r in records:
        command = r.get("config", {}).get("command", "")
        if " -m xpnn " in f" {command} ":
            r["predicted"] = predict_record(r["config"], calibration)


def predicted(r: dict[str, Any], metric: str) -> float | None:
    """The predicted ``metric`` (``epoch_s``, ``train_s``, ``step_s``) of a record, or None."""
    return (r.get("predicted") or {}).get(metric)


def why_none(records: list[dict[str, Any]]) -> str:
    """Why records carry no prediction, one sentence ('' when every one has one)."""
    reasons = sorted({(r.get("predicted") or {}).get("none", "") for r in records} - {""})
    return "No prediction for some runs: " + "; ".join(reasons) + "." if reasons else ""
