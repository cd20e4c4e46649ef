"""A run's model as the planner sees it: built from the settings alone (its data set's shape,
not its data), its work per sample, and its step's cost beyond its products (``rest``)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from xpnn.nn.gpt import GPT_DEFAULTS
from xpnn.planner.machine import Machine
from xpnn.planner.work import ModelWork, model_work

TEXT_VOCAB = 65  # Tiny Shakespeare's characters: the vocabulary when no text is at hand
PER_STEP = "per-step"  # a rest key's suffix: its seconds a step (the key alone: a sample's)


def _model(spec: Any) -> tuple[Any, tuple[int, ...], int]:
    from xpnn.data.text import TEXT_DATASETS
    from xpnn.nn.models import make_model

    text = spec.dataset in TEXT_DATASETS
    shape, classes = ((spec.block,), TEXT_VOCAB) if text else ((1, 28, 28), 10)
    sizes = {name: getattr(spec, name) for name in GPT_DEFAULTS}
    model = make_model(
        spec.model, shape, classes, spec.hidden, spec.activation, spec.loss, gpt_sizes=sizes
    )
    return model, shape, classes


def work_of(spec: Any, machine: Machine | None = None, threads: tuple[int, ...] = ()) -> ModelWork:
    """The per-sample work of ``spec``'s model (resolved: the recipe and defaults filled);
    with a ``machine`` measured here, what its step costs beyond its products at each of
    ``threads`` (measured once on ``spec``'s backend, then kept in the calibration)."""
    from xpnn.backends import get_backend

    model, shape, classes = _model(spec)
    work = model_work(model, shape, get_backend("numpy", spec.dtype), spec.seed)
    if machine is None or not threads:
        return work
    from xpnn.planner.rest import measure_rest

    backend = get_backend(spec.backend, spec.dtype)
    layers = " -> ".join(repr(layer) for layer in getattr(model, "layers", [model]))
    digest = hashlib.sha256(f"{shape} {layers}".encode()).hexdigest()[:12]  # the model's name
    name = f"{backend.name} {spec.dtype} {{}} {digest}"
    for t in threads:
        key = name.format(t)
        if key not in machine.rest or f"{key} {PER_STEP}" not in machine.rest:
            if not machine.measured:  # a file measured elsewhere: what it holds (per sample)
                if key in machine.rest:
                    work.rest[t] = machine.rest[key]
                continue
            built = _model(spec)[0].build(shape, backend, spec.seed)
            fixed, slope = measure_rest(machine, work, built, classes, t, spec.dtype)
            machine.rest[key], machine.rest[f"{key} {PER_STEP}"] = slope, fixed
        work.rest[t] = machine.rest[key]
        work.rest_per_step[t] = machine.rest[f"{key} {PER_STEP}"]
    return work


HOST_BUFFER_BACKENDS = ("torch", "cupy")  # arrays node-shared memory cannot hold


def as_run(spec: Any, layout: Any) -> Any:
    """``layout`` on the transport ``spec``'s run takes: ``auto`` is node-shared memory on a
    NumPy-array backend and host buffers on the others (``parallel.comm``)."""
    if layout.comm == "auto" and spec.backend in HOST_BUFFER_BACKENDS:
        return dataclasses.replace(layout, comm="mpi-host")
    return layout
