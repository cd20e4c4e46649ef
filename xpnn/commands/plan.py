"""``python -m xpnn calibrate``, ``plan`` and ``explain``: measure this machine once, rank every
layout of a run, and set a run's measured step beside its prediction."""

import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from xpnn.commands.flags import READERS, Parser, build_parser, to_spec, typed
from xpnn.errors import UserError
from xpnn.nn.layer import is_int
from xpnn.planner.auto import layouts, node_layouts
from xpnn.planner.cost import Layout, Prediction, predict
from xpnn.planner.machine import Machine, cache_path, cached, load, mpiexec_path, save
from xpnn.planner.work import as_run, work_of
from xpnn.record.plot import read_epochs
from xpnn.record.timeline import merge, summarize
from xpnn.run import BATCH, resolve
from xpnn.runtime import failure
from xpnn.runtime.threads import node_cores
from xpnn.settings import MOST, THREADS, Range

MAX_RANKS = 64  # more ranks than this are not planned on one machine
NODES = typed(Range(1, MAX_RANKS, whole=True).read)
WHOLE = {low: typed(Range(low, MOST, whole=True).read) for low in (0, 1, 2)}  # whole numbers >= low
PARTS = ("compute", "communication exposed", "communication hidden", "pipeline bubble")
PARTS += ("waiting for other ranks",)


def spec_from(argv: list[str]) -> Any:
    return resolve(to_spec(build_parser().parse_args(argv)))[0]


def machine_for(path: str | None) -> Machine:
    if path:  # a machine measured elsewhere: nothing is measured here
        return replace(load(path), measured=False)
    return cached(node_cores())[0]


def global_batch(spec: Any) -> int:
    """The run's global batch, a whole number (a full batch needs the data)."""
    batch = BATCH if spec.batch_size is None else spec.batch_size
    if isinstance(batch, str) and batch.strip().isdigit():
        batch = int(batch)
    if not is_int(batch) or batch < 1:
        raise UserError(f"`batch_size` {batch!r}: the planner needs a whole number >= 1")
    return int(batch)


def predict_run(flags: list[str], layout: Any, calibration: str | None = None) -> tuple[Any, int]:
    """(run ``flags``'s prediction as ``layout``, its global batch), here or on ``calibration``."""
    spec = spec_from(flags)
    layout = as_run(spec, layout)
    machine = machine_for(calibration)
    work = work_of(spec, machine, (layout.threads // layout.batch_threads, layout.threads))
    batch = global_batch(spec)
    pred = predict(machine, work, layout, batch, spec.optimizer, spec.dtype)
    if calibration is None:
        save(machine, cache_path(machine.key))
    return pred, batch


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


def plan(argv: list[str]) -> None:
    parser = Parser(
        prog="python -m xpnn plan",
        description="Rank every layout of a run by its predicted time per step on this machine.",
        epilog="Any training flag (python -m xpnn --help) describes the run: --model, --hidden, "
        "--batch-size, --dataset, --dtype, --optimizer, --backend...",
    )
    add = parser.add_argument
    add("--ranks", type=int, help="plan up to N ranks (the cores)")
    add("--calibration", help="plan for the machine this file holds")
    add("--nodes", type=NODES, default=1, help="plan for N nodes like the calibrated one (1)")
    add("--cores-per-node", type=typed(THREADS.read), help="cores of each node (the calibration's)")
    add("--json", action="store_true", help="every plan, its flags and costs")
    add("--top", type=WHOLE[1], default=12, help="plans printed (12)")
    add("--measure", type=WHOLE[0], default=0, help="run the K fastest, the middle and the slowest")
    add("--measure-steps", type=WHOLE[2], default=20, help="steps each measured run trains (20)")
    own, rest = parser.parse_known_args(argv)
    if own.measure and (own.nodes > 1 or own.cores_per_node is not None):
        raise UserError("--measure runs the plans here: not with --nodes or --cores-per-node")
    spec = spec_from(rest)
    machine = machine_for(own.calibration)
    if own.cores_per_node is not None and own.cores_per_node != machine.cores:
        machine.key = {**machine.key, "cores": own.cores_per_node}
        machine.measured = False  # another node than this one: nothing measured here
    cores, max_ranks = machine.cores, own.ranks or machine.cores
    if not 1 <= max_ranks <= MAX_RANKS:
        raise UserError(f"--ranks {max_ranks}: must be 1 to {MAX_RANKS}")
    if own.nodes > 1 and not machine.network_measured:
        print(
            "xpnn plan: the calibration holds no network between nodes: priced at 25 us + "
            '10 Gb/s (a "network": {"alpha": s, "beta": s/byte} entry in it sets them)',
            file=sys.stderr,
        )
    work = work_of(spec, machine, tuple(range(1, cores + 1)))
    batch = global_batch(spec)
    if own.nodes > 1:
        candidates = node_layouts(cores, own.nodes, max_ranks, batch, work)
    else:
        candidates = layouts(work, cores, max_ranks, batch)
    if not candidates:
        raise UserError(f"--batch-size {batch}: fewer samples than the ranks of any layout")
    found = [
        predict(machine, work, as_run(spec, layout), batch, spec.optimizer, spec.dtype)
        for layout in candidates
    ]
    found.sort(key=lambda p: p.step)
    if machine.measured:  # the products measured on the way (a --calibration is not)
        save(machine, cache_path(machine.key))
    picks = list(range(min(own.measure, len(found))))  # the K fastest, the middle, the slowest
    if picks:
        picks += [i for i in (len(found) // 2, len(found) - 1) if i not in picks]
    measured = {i: measure_one(found[i], rest, own.measure_steps) for i in picks}
    if own.json:
        rows = [p.to_json() for p in found]
        for i, seconds in measured.items():
            rows[i] |= {} if seconds is None else {"measured_step_s": seconds}
        print(json.dumps(rows, indent=1))
        return
    unit = "tokens/s" if work.tokens_per_sample > 1 else "samples/s"
    shape = f"{own.nodes} nodes x {cores} cores" if own.nodes > 1 else f"{cores} cores"
    print(f"xpnn plan: {shape}, global batch {batch}, {spec.dtype}, {spec.optimizer}")
    seen = " measured ms" if measured else ""
    wide = max(56, *(len(p.layout.describe()) for p in found))
    print(f"{'#':>3} {'layout':<{wide}} {unit:>11} {'step ms':>8}{seen} {'MB/rank':>8}  largest")
    for i, p in enumerate(found, 1):
        if i > own.top and i - 1 not in measured:
            continue
        mb = sum(p.memory.values()) / 2**20
        got = measured.get(i - 1)
        cell = (f" {1e3 * got:>11.2f}" if got else f" {'-':>11}") if measured else ""
        print(
            f"{i:>3} {p.layout.describe():<{wide}} {p.rate:>11,.0f} {1e3 * p.step:>8.2f}{cell} "
            f"{mb:>8.1f}  {p.largest()}"
        )
    best = found[0].layout
    launch = f"mpiexec -n {best.ranks} " if best.ranks > 1 else ""
    launch += f"-ppn {best.local_ranks} " if best.nodes > 1 else ""
    print(f"fastest: {launch}python -m xpnn {' '.join(best.flags())}")


def measure_one(pred: Prediction, flags: list[str], steps: int) -> float | None:
    """Seconds per step of ``pred``'s layout run for ``steps`` steps, None where it failed."""
    with tempfile.TemporaryDirectory(prefix="xpnn-plan-") as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        command = [sys.executable, "-m", "xpnn", *flags, *pred.layout.flags()]
        command += ["--steps", str(steps), "--eval-every", str(max(1, steps // 2)), "--no-progress"]
        command += ["--metrics", metrics]
        if pred.layout.ranks > 1:
            command = [mpiexec_path(), "-n", str(pred.layout.ranks), *command]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=900)
            return measured_step(read_epochs(Path(metrics)))[1] if done.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, UserError):
            return None


def calibrate_main(argv: list[str]) -> None:
    parser = Parser(
        prog="python -m xpnn calibrate",
        description="Measure this machine once for the planner (cached per host and libraries).",
    )
    add = parser.add_argument
    add("--quick", action="store_true", help="fewer sizes and repeats (< 1 min)")
    add("--ranks", type=typed(READERS["sizes"]), help="rank counts to time collectives on (2,4)")
    add("--models", default="mlp,cnn,gpt", help="the presets whose products to time (mlp,cnn,gpt)")
    add("--backend", help="the backend whose kernels to time")
    args = parser.parse_args(argv)
    cores = node_cores()
    backend = ["--backend", args.backend] if args.backend else []
    ranks = list(args.ranks or ([2] if args.quick else sorted({2, cores, 2 * cores} - {1})))
    shapes = set()
    if not set(models := args.models.split(",")) <= {"mlp", "cnn", "gpt"}:
        raise UserError(f"--models {args.models}: choose among mlp, cnn, gpt")
    specs = []
    for name in models:
        spec = spec_from(["--model", name, "--dataset", "synthetic", *backend])
        if spec.model == "gpt":
            spec = replace(spec, dataset="tinyshakespeare")
        specs.append(spec)
        batch, shares = global_batch(spec), (1, 2, 4) if args.quick else (1, 2, 4, 8)
        shapes |= {g.at(math.ceil(batch / s)) for s in shares for g in work_of(spec).gemms()}
    machine, path = cached(cores)
    threads = sorted({1, cores} if args.quick else set(range(1, cores + 1)))
    for dtype in ("float32",) if args.quick else ("float32", "float64"):
        for t in threads:
            machine.values_per_s(t, dtype)
            for m, k, n, count in sorted(shapes):
                machine.gemm_seconds(m, k, n, count, t, dtype)
    for r in ranks:
        machine.probe(r, args.quick)
    save(machine, path)  # the products and collectives kept, whatever comes next
    for spec in specs:  # each preset's step beyond its products, on the chosen backend
        work_of(spec, machine, tuple(threads))
    save(machine, path)
    print(f"xpnn calibrate: {len(machine.gemm)} products, ranks {ranks}: {path}")


def main(command: str, argv: list[str]) -> int:
    try:
        {"calibrate": calibrate_main, "explain": explain, "plan": plan}[command](argv)
        return 0
    except UserError as exc:
        print(f"xpnn {command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # `| head`, a full disk: one line, as training says it
        message, code = failure.stopped_from_outside(exc) or (failure.describe(exc), 1)
        failure.say(f"xpnn: {message}")
        return code
