"""A run's model as the planner sees it: built from the settings alone (its data set's shape,
not its data), and its work per sample (``work``), with what its step costs beyond its
products measured on its backend (``rest``)."""

from __future__ import annotations

from typing import Any

from xpnn.nn.gpt import GPT_DEFAULTS
from xpnn.planner.machine import Machine
from xpnn.planner.work import ModelWork, model_work

TEXT_VOCAB = 65  # Tiny Shakespeare's characters: the vocabulary when no text is at hand
PER_STEP = "per-step"  # a rest key's suffix: its seconds a step (the key alone: a sample's)


def data_shape(spec: Any) -> tuple[tuple[int, ...], int]:
    """(input shape, classes) of ``spec``'s data set, without loading it."""
    from xpnn.data.text import TEXT_DATASETS

    if spec.dataset in TEXT_DATASETS:
        return (spec.block,), TEXT_VOCAB
    return (1, 28, 28), 10


def _model(spec: Any) -> tuple[Any, tuple[int, ...], int]:
    from xpnn.nn.models import make_model

    shape, classes = data_shape(spec)
    model = make_model(
        spec.model,
        shape,
        classes,
        spec.hidden,
        spec.activation,
        spec.loss,
        gpt_sizes={name: getattr(spec, name) for name in GPT_DEFAULTS},
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
    name = f"{backend.name} {spec.dtype} {{}} {model_digest(model, shape)}"
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


def model_digest(model: Any, shape: tuple[int, ...]) -> str:
    """A short name for a model's layers and input: what its measured rest is kept under."""
    import hashlib

    text = f"{shape} " + " -> ".join(repr(layer) for layer in getattr(model, "layers", [model]))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


HOST_BUFFER_BACKENDS = ("torch", "cupy")  # arrays node-shared memory cannot hold


def as_run(spec: Any, layout: Any) -> Any:
    """``layout`` on the transport ``spec``'s run takes: ``auto`` is node-shared memory on a
    NumPy-array backend (``numpy``, ``numba``, ``auto`` on a CPU) and host buffers on the
    others (``parallel.comm``)."""
    import dataclasses

    if layout.comm == "auto" and spec.backend in HOST_BUFFER_BACKENDS:
        return dataclasses.replace(layout, comm="mpi-host")
    return layout
