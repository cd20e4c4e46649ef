"""What the planner's commands read: a run's settings from its flags, and a calibration."""

from dataclasses import replace
from typing import Any

from xpnn.commands.flags import build_parser, to_spec
from xpnn.errors import UserError
from xpnn.nn.layer import is_int
from xpnn.planner.cost import predict
from xpnn.planner.machine import Machine, cache_path, cached, load, save
from xpnn.planner.models import as_run, work_of
from xpnn.run import BATCH, resolve
from xpnn.runtime.threads import node_cores

__all__ = ["global_batch", "machine_for", "predict_run", "spec_from", "work_of"]


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
