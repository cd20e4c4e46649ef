"""What the planner's commands read: a run's settings from its flags, the model's work from
them, and a machine's calibration."""

from __future__ import annotations

from typing import Any

from xpnn.errors import UserError
from xpnn.planner.machine import Machine, cached, load
from xpnn.planner.work import ModelWork, model_work

TEXT_VOCAB = 65  # Tiny Shakespeare's characters: the vocabulary when no text is at hand


def data_shape(spec: Any) -> tuple[tuple[int, ...], int]:
    """(input shape, classes) of ``spec``'s data set, without loading it."""
    from xpnn.data.text import TEXT_DATASETS

    if spec.dataset in TEXT_DATASETS:
        return (spec.block,), TEXT_VOCAB
    return (1, 28, 28), 10


def _model(spec: Any) -> tuple[Any, tuple[int, ...], int]:
    from xpnn.nn.models import make_model
    from xpnn.run import gpt_settings

    shape, classes = data_shape(spec)
    model = make_model(
        spec.model,
        shape,
        classes,
        spec.hidden,
        spec.activation,
        spec.loss,
        gpt_sizes=gpt_settings(spec),
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
        if name.format(t) not in machine.rest:
            if not machine.measured:
                continue
            built = _model(spec)[0].build(shape, backend, spec.seed)
            machine.rest[name.format(t)] = measure_rest(
                machine, work, built, classes, t, spec.dtype
            )
        work.rest[t] = machine.rest[name.format(t)]
    return work


def model_digest(model: Any, shape: tuple[int, ...]) -> str:
    """A short name for a model's layers and input: what its measured rest is kept under."""
    import hashlib

    text = f"{shape} " + " -> ".join(repr(layer) for layer in getattr(model, "layers", [model]))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def spec_from(argv: list[str]) -> Any:
    from xpnn.flags import ArgError, build_parser, to_spec
    from xpnn.run import resolve

    try:
        args = build_parser().parse_args(argv)
    except ArgError as exc:
        raise UserError(str(exc)) from None
    spec, _ = resolve(to_spec(args))
    return spec


def machine_for(path: str | None) -> Machine:
    if path:
        machine = load(path)
        machine.measured = False
        return machine
    from xpnn.runtime.threads import node_cores

    return cached(node_cores())[0]


def global_batch(spec: Any) -> int:
    """The run's global batch, checked: a whole number >= 1 (a full batch needs the data)."""
    from xpnn.nn.layer import is_int
    from xpnn.run import BATCH

    batch = BATCH if spec.batch_size is None else spec.batch_size
    if isinstance(batch, str) and batch.strip().isdigit():
        batch = int(batch)
    if not is_int(batch) or batch < 1:
        raise UserError(f"`batch_size` {batch!r}: the planner needs a whole number >= 1")
    return int(batch)
