"""The layouts a run could take; for ``auto`` settings, the one predicted fastest, then kept."""

import dataclasses
from typing import Any

from xpnn.errors import UserError
from xpnn.parallel.model.tensor import split_layers
from xpnn.parallel.plan import check
from xpnn.planner.cost import Layout, Prediction, predict
from xpnn.planner.machine import Machine, cache_path, cached, save
from xpnn.planner.work import ModelWork, as_run, work_of
from xpnn.train.checkpoint import _json_meta, latest_checkpoint, read_npz

AUTO = "auto"
CHOSEN = ("parallel", "threads", "batch_threads")  # the settings ``auto`` may stand for
MODES = ("data", "tensor", "pipeline")  # tried in this order: the first of equals wins


def wanted(spec: Any) -> bool:
    return any(getattr(spec, name) == AUTO for name in CHOSEN)


def free_cores(cores: int, runnable: int | None, own: int = 1) -> int:
    """``cores`` less those other threads keep busy (``runnable`` counts ``own`` too), >= 1."""
    if runnable is None:
        return cores
    return max(1, min(cores, cores - (runnable - own)))


def stored_choice(directory: str | None) -> dict[str, Any] | None:
    """What ``auto`` chose for the run whose latest checkpoint is in ``directory``."""
    if (path := latest_checkpoint(directory) if directory else None) is None:
        return None
    try:
        settings = _json_meta(path, read_npz(path), "settings")
    except UserError:
        return None  # the resume itself says what is wrong with the file
    chosen = settings.get(AUTO)
    if not isinstance(chosen, dict) or not set(CHOSEN) <= set(chosen):
        return None
    return {name: chosen[name] for name in CHOSEN}


def tensor_fits(work: ModelWork, parts: int) -> bool:
    """Whether tensor parallelism's own split accepts the model over ``parts`` ranks."""
    try:
        split_layers(work.top_layers, 0, parts)
    except (UserError, ValueError):
        return False
    return bool(work.top_layers)


def _splits(work: ModelWork | None, ranks: int, t: int, batch: int, nodes: int) -> list[Layout]:
    """Layouts of ``ranks`` ranks of ``t`` threads: data; with ``work``, tensor and pipeline."""
    divisors = [k for k in range(1, t + 1) if t % k == 0 and batch >= ranks * k]
    out = [Layout(ranks, t, "data", k, comm="auto", nodes=nodes) for k in divisors]
    if work is None or ranks == 1:
        return out
    if tensor_fits(work, ranks):
        out.append(Layout(ranks, t, "tensor", nodes=nodes))
    if sum(1 for layer in work.layers if layer.params) >= ranks:
        for m in (m for m in (ranks, 2 * ranks, 4 * ranks) if m <= batch):
            for schedule in ("gpipe", "1f1b"):
                out.append(Layout(ranks, t, "pipeline", 1, m, schedule, nodes=nodes))
    return out


def layouts(work: ModelWork, cores: int, max_ranks: int, batch: int) -> list[Layout]:
    """Every layout of up to ``max_ranks`` ranks on ``cores`` cores the planner can price."""
    out = []
    for r in (r for r in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64) if r <= max_ranks):
        for t in [t for t in range(1, cores // r + 1) if cores % (r * t) == 0] or [1]:
            out += _splits(work, r, t, batch, 1)
    return out


def node_layouts(
    cores: int, nodes: int, max_ranks: int, batch: int, work: ModelWork | None = None
) -> list[Layout]:
    """Every split of ``nodes`` nodes' ``cores`` into ranks, threads and batch threads."""
    fits = [r for r in range(1, min(cores, max_ranks) + 1) if cores % r == 0]
    return [x for r in fits for x in _splits(work, nodes * r, cores // r, batch, nodes)]


def candidates(spec: Any, ranks: int, cores: int) -> list[dict[str, Any]]:
    """Every value the ``auto`` settings may take, the given ones held, in a fixed order."""
    modes = ("data",) if ranks == 1 else MODES if spec.parallel == AUTO else (spec.parallel,)
    threads = range(cores, 0, -1) if spec.threads == AUTO else (spec.threads or cores,)
    out = []
    for mode in modes:
        for t in threads:
            divisors = [k for k in range(1, t + 1) if t % k == 0] if mode == "data" else [1]
            ks = divisors if spec.batch_threads == AUTO else [spec.batch_threads]
            out += [{"parallel": mode, "threads": t, "batch_threads": k} for k in ks]
    return out


def choose(
    spec: Any, ranks: int, cores: int, machine: Machine | None = None
) -> tuple[dict[str, Any], Prediction]:
    """The candidate predicted fastest for ``spec`` (resolved but for its ``auto`` settings)."""
    machine = machine or cached(cores)[0]
    options = candidates(spec, ranks, cores)
    threads = {t for o in options for t in (o["threads"] // o["batch_threads"], o["threads"])}
    work = work_of(spec, machine, tuple(sorted(threads)))
    batch = spec.batch_size if isinstance(spec.batch_size, int) else 128
    held = {"microbatches": spec.microbatches or 4, "comm": spec.comm or "auto"}
    held["schedule"] = spec.pipeline_schedule or "gpipe"
    found: list[tuple[dict[str, Any], Prediction]] = []
    for option in options:
        try:
            check(dataclasses.replace(spec, **option))
        except UserError:
            continue
        if option["parallel"] == "tensor" and not tensor_fits(work, ranks):
            continue
        if option["parallel"] == "pipeline" and sum(1 for w in work.layers if w.params) < ranks:
            continue
        layout = as_run(spec, Layout(ranks, **option, **held))
        found.append((option, predict(machine, work, layout, batch, spec.optimizer, spec.dtype)))
    if not found:
        raise UserError("`parallel` auto: no layout fits these settings")
    if machine.measured:
        save(machine, cache_path(machine.key))  # what was measured on the way, for the next
    return min(found, key=lambda option_pred: option_pred[1].step)  # the first of equals


def resolve_auto(spec: Any, ranks: int, local_ranks: int, node_cores: int) -> tuple[dict, str]:
    """(the settings ``auto`` stands for, the line saying them): a resume's, else the fastest."""
    chosen = stored_choice(spec.checkpoint_dir) if spec.resume else None
    line = "auto: kept from the checkpoint: {}"
    if chosen is None:
        try:  # threads running or ready to run now: /proc/loadavg's fourth field
            with open("/proc/loadavg", encoding="ascii") as f:
                runnable = int(f.read().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            runnable = None
        free = free_cores(node_cores, runnable, own=1)
        chosen, pred = choose(spec, ranks, max(1, free // max(1, local_ranks)))
        unit = "tokens/s" if pred.tokens_per_sample > 1 else "samples/s"
        line = f"auto: {{}} (predicted {pred.rate:,.0f} {unit}; these flags repeat it)"
        if free < node_cores:
            line += f" (the machine is busy: planned for {free} of its {node_cores} cores)"
    return chosen, line.format(" ".join(f"--{n.replace('_', '-')} {chosen[n]}" for n in CHOSEN))
