"""``python -m xpnn explain RUN``: a run's measured step beside the cost model's prediction
for the same layout, split into compute, communication (hidden and exposed), the pipeline's
bubble and waiting for the slowest rank, and the largest gap named in one sentence."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from typing import Any

from xpnn.commands.inputs import Parser
from xpnn.errors import UserError
from xpnn.planner.cost import Layout, Prediction, predict

MAX_METRICS_BYTES = 256 << 20


def read_metrics(path: str) -> list[dict[str, Any]]:
    """The records of a metrics file (a regular file, at most ``MAX_METRICS_BYTES``)."""
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise UserError(f"explain {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise UserError(f"explain {path}: not a regular file")
        raw = f.read(MAX_METRICS_BYTES + 1)
    if len(raw) > MAX_METRICS_BYTES:
        raise UserError(
            f"explain {path}: larger than a metrics file ({MAX_METRICS_BYTES >> 20} MiB)"
        )
    records = []
    for line in raw.decode("utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    if not any(r.get("event") in ("epoch", "eval") for r in records):
        raise UserError(f"explain {path}: no epoch or evaluation record (an xpnn --metrics file?)")
    return records


def measured_step(records: list[dict[str, Any]]) -> tuple[dict[str, Any], float]:
    """The last timed record and its seconds per step (global batch over the rate)."""
    timed = [r for r in records if r.get("event") in ("epoch", "eval") and r.get("samples_per_s")]
    if not timed:
        raise UserError("explain: no record with a rate (samples_per_s)")
    last = timed[-1]
    return last, float(last["global_batch"]) / float(last["samples_per_s"])


def layout_of(record: dict[str, Any]) -> Layout:
    ranks = int(record.get("world_size", 1))
    parallel = str(record.get("parallel", "data")) if ranks > 1 else "data"
    return Layout(
        ranks=ranks,
        threads=int(record.get("threads", 1)),
        parallel=parallel,
        batch_threads=int(record.get("batch_threads", 1) or 1),
        microbatches=int(record.get("microbatches", ranks) or ranks),
        comm=str(record.get("comm", "auto")),
    )


def prediction_for(record: dict[str, Any], machine: Any, flags: list[str]) -> Prediction:
    """The prediction for the run ``record`` describes; ``flags``: the run's own model flags
    the record does not keep (``--hidden``, ``--layers``...), which win."""
    from xpnn.commands.inputs import spec_from, work_of

    argv = ["--dataset", str(record.get("dataset", "synthetic"))]
    if record.get("model") in ("mlp", "cnn", "gpt"):
        argv += ["--model", record["model"]]
    spec = spec_from([*argv, *flags])
    spec = replace(spec, dtype=str(record.get("dtype", spec.dtype)))
    layout = layout_of(record)
    work = work_of(spec, machine, (layout.threads // layout.batch_threads, layout.threads))
    return predict(machine, work, layout, int(record["global_batch"]), spec.optimizer, spec.dtype)


def trace_split(directory: str) -> dict[str, float] | None:
    """The slowest rank's traced step, ms: compute, communication, waiting, hidden share."""
    from xpnn.record.timeline import merge, summarize

    merged, info = merge(directory)
    rows = summarize(merged, info)
    if not rows:
        return None
    return max(rows, key=lambda row: row["step_ms"])


def verdict(measured: float, pred: Prediction, split: dict[str, Any] | None, cores: int) -> str:
    """The largest gap between measurement and prediction, as something a student can act on."""
    layout = pred.layout
    busy = layout.ranks * layout.threads
    if busy > cores:
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
        exposed = split["communication_ms"] * (1 - (split.get("hidden") or 0.0))
        if exposed / step > 0.25:
            return (
                f"communication exposed for {100 * exposed / step:.0f}% of the step: larger "
                "--bucket-mb (fewer latencies) or fewer ranks"
            )
        if split["waiting_ms"] / step > 0.25:
            return (
                f"waiting for the slowest rank {100 * split['waiting_ms'] / step:.0f}% of the step"
            )
    ratio = measured / pred.step
    if ratio > 1.3:
        load = os.getloadavg()[0]
        return (
            f"{ratio:.1f}x slower than predicted with no communication to blame: the cores were "
            f"likely shared (load average now {load:.1f} on {cores} cores), or the calibration "
            "is stale (python -m xpnn calibrate)"
        )
    if ratio < 0.77:
        return f"{1 / ratio:.1f}x faster than predicted: the calibration ran on a busier machine"
    close = abs(ratio - 1) * 100
    return f"within {close:.0f}% of the prediction; the largest cost is {pred.largest()}"


def explain(argv: list[str], out: Any = sys.stdout) -> str:
    parser = Parser(
        prog="python -m xpnn explain",
        epilog="Other flags are the run's own model flags the metrics do not keep (--hidden).",
    )
    parser.add_argument("run", help="a --metrics file, or a --trace directory")
    parser.add_argument("--trace", help="the run's --trace directory (with a metrics file)")
    parser.add_argument("--metrics", help="the run's --metrics file (with a trace directory)")
    parser.add_argument("--calibration", help="a calibration file (default: this machine's)")
    args, flags = parser.parse_known_args(argv)
    metrics, trace = args.metrics, args.trace
    if os.path.isdir(args.run):
        trace = args.run
    else:
        metrics = args.run
    if metrics is None:
        raise UserError("explain: give the run's --metrics file (and its --trace directory)")
    from xpnn.commands.inputs import machine_for

    machine = machine_for(args.calibration)
    record, measured = measured_step(read_metrics(metrics))
    pred = prediction_for(record, machine, flags)
    split = trace_split(trace) if trace else None
    print(
        f"xpnn explain: {pred.layout.describe()}, global batch {record['global_batch']}", file=out
    )
    print(f"{'':<28}{'measured ms':>12}{'predicted ms':>14}", file=out)
    print(f"{'step':<28}{1e3 * measured:>12.3f}{1e3 * pred.step:>14.3f}", file=out)
    compute = pred.forward + pred.wgrad + pred.dgrad + pred.elementwise + pred.optimizer
    rows = [
        ("compute", split["compute_ms"] - split["communication_ms"] if split else None, compute),
        ("communication exposed", _exposed(split), pred.comm_exposed),
        ("communication hidden", _hidden(split), pred.comm_hidden),
        ("pipeline bubble", _bubble(split), pred.bubble),
        ("waiting for other ranks", split["waiting_ms"] if split else None, pred.sync_wait),
    ]
    for name, seen, predicted in rows:
        seen_text = f"{seen:>12.2f}" if seen is not None else f"{'-':>12}"
        pred_text = f"{1e3 * predicted:>14.2f}" if predicted is not None else f"{'-':>14}"
        print(f"{name:<28}{seen_text}{pred_text}", file=out)
    line = verdict(measured, pred, split, machine.cores)
    print(f"largest gap: {line}", file=out)
    return line


def _exposed(split: dict[str, Any] | None) -> float | None:
    if not split:
        return None
    return split["communication_ms"] * (1 - (split.get("hidden") or 0.0))


def _hidden(split: dict[str, Any] | None) -> float | None:
    if not split:
        return None
    return split["communication_ms"] * (split.get("hidden") or 0.0)


def _bubble(split: dict[str, Any] | None) -> float | None:
    if not split or split.get("bubble") is None:
        return None
    return split["bubble"] * split["step_ms"]
