"""``python -m xpnn explain RUN``: a run's measured step beside its prediction; the largest gap."""

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from xpnn.commands.flags import Parser
from xpnn.commands.inputs import machine_for, spec_from, work_of
from xpnn.errors import UserError
from xpnn.planner.cost import Layout, Prediction, predict
from xpnn.record.plot import read_epochs
from xpnn.record.timeline import merge, summarize

PARTS = ("compute", "communication exposed", "communication hidden", "pipeline bubble")
PARTS += ("waiting for other ranks",)


def measured_step(records: list[dict[str, Any]]) -> tuple[dict[str, Any], float]:
    """(the last timed ``epoch``/``eval`` record of a metrics file, its seconds per step)."""
    timed = [r for r in records if r.get("event") in ("epoch", "eval") and r.get("samples_per_s")]
    if not timed:
        raise UserError("explain: no record with a rate (samples_per_s)")
    last = timed[-1]
    return last, float(last["global_batch"]) / float(last["samples_per_s"])


def prediction_for(record: dict[str, Any], machine: Any, flags: list[str]) -> Prediction:
    """``flags``: the run's model flags the record does not keep (``--hidden``), which win."""
    argv = ["--dataset", str(record.get("dataset", "synthetic"))]
    if record.get("model") in ("mlp", "cnn", "gpt"):
        argv += ["--model", record["model"]]
    spec = spec_from([*argv, *flags])
    spec = replace(spec, dtype=str(record.get("dtype", spec.dtype)))
    ranks, threads = int(record.get("world_size", 1)), int(record.get("threads", 1))
    parallel = str(record.get("parallel", "data")) if ranks > 1 else "data"
    twins, micro = record.get("batch_threads", 1) or 1, record.get("microbatches", ranks) or ranks
    comm = str(record.get("comm", "auto"))
    layout = Layout(ranks, threads, parallel, int(twins), int(micro), comm=comm)
    work = work_of(spec, machine, (layout.threads // layout.batch_threads, layout.threads))
    return predict(machine, work, layout, int(record["global_batch"]), spec.optimizer, spec.dtype)


def verdict(measured: float, pred: Prediction, split: dict[str, Any] | None, cores: int) -> str:
    """The largest gap between measurement and prediction, as something a student can act on."""
    layout = pred.layout
    if (busy := layout.ranks * layout.threads) > cores:
        return (
            f"oversubscribed: {layout.ranks} rank(s) x {layout.threads} thread(s) = {busy} "
            f"threads on {cores} cores, waiting at each of a step's {pred.syncs} "
            f"synchronizations for the others' turns ({1e3 * pred.sync_wait:.1f} ms predicted); "
            f"run --threads {max(1, cores // layout.ranks)} or fewer ranks"
        )
    if split is not None:
        step = split["step_ms"] or 1.0
        if split.get("bubble") and split["bubble"] > 0.25:
            return (
                f"a pipeline bubble of {100 * split['bubble']:.0f}% of the step: "
                f"more --microbatches (now {layout.microbatches}) shrink it"
            )
        if (exposed := _traced(split)[1]) / step > 0.25:
            return (
                f"communication exposed for {100 * exposed / step:.0f}% of the step: larger "
                "--bucket-mb (fewer latencies) or fewer ranks"
            )
        if split["waiting_ms"] / step > 0.25:
            return f"waiting for the slowest rank {split['waiting_ms'] / step:.0%} of the step"
    if (ratio := measured / pred.step) > 1.3:
        return (
            f"{ratio:.1f}x slower than predicted with no communication to blame: the cores were "
            f"likely shared (load average now {os.getloadavg()[0]:.1f} on {cores} cores), or the "
            "calibration is stale (python -m xpnn calibrate)"
        )
    if ratio < 0.77:
        return f"{1 / ratio:.1f}x faster than predicted: the calibration ran on a busier machine"
    return f"within {abs(ratio - 1):.0%} of the prediction; the largest cost is {pred.largest()}"


def explain(argv: list[str]) -> None:
    parser = Parser(
        prog="python -m xpnn explain",
        epilog="Other flags are the run's own model flags the metrics do not keep (--hidden).",
    )
    add = parser.add_argument
    add("run", help="a --metrics file, or a --trace directory")
    add("--trace", help="the run's --trace directory (with a metrics file)")
    add("--metrics", help="the run's --metrics file (with a trace directory)")
    add("--calibration", help="a calibration file (default: this machine's)")
    args, flags = parser.parse_known_args(argv)
    metrics, trace = (args.metrics, args.run) if os.path.isdir(args.run) else (args.run, args.trace)
    if metrics is None:
        raise UserError("explain: give the run's --metrics file (and its --trace directory)")
    machine = machine_for(args.calibration)
    record, measured = measured_step(read_epochs(Path(metrics)))
    pred = prediction_for(record, machine, flags)
    # the slowest rank's traced step, ms: compute, communication, waiting, hidden share
    split = max(summarize(*merge(trace)) if trace else [], key=lambda r: r["step_ms"], default=None)
    print(f"xpnn explain: {pred.layout.describe()}, global batch {record['global_batch']}")
    print(f"{'':<28}{'measured ms':>12}{'predicted ms':>14}")
    print(f"{'step':<28}{1e3 * measured:>12.3f}{1e3 * pred.step:>14.3f}")
    compute = pred.forward + pred.wgrad + pred.dgrad + pred.elementwise + pred.optimizer
    predicted = (compute, pred.comm_exposed, pred.comm_hidden, pred.bubble, pred.sync_wait)
    for name, seen, want in zip(PARTS, _traced(split), predicted, strict=True):
        seen_text = f"{seen:>12.2f}" if seen is not None else f"{'-':>12}"
        print(f"{name:<28}{seen_text}{1e3 * want:>14.2f}")
    print(f"largest gap: {verdict(measured, pred, split, machine.cores)}")


def _traced(split: dict[str, Any] | None) -> tuple[float | None, ...]:
    if not split:
        return (None,) * 5
    comm, hidden = split["communication_ms"], split.get("hidden") or 0.0
    bubble = split["bubble"] * split["step_ms"] if split.get("bubble") is not None else None
    compute = split["compute_ms"] - comm
    return compute, comm * (1 - hidden), comm * hidden, bubble, split["waiting_ms"]
