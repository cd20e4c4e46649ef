"""Saved parameters and checkpoints: plain ``.npz`` files, written atomically.

``--save`` writes every parameter under its stable name (``layer0.W``...); a checkpoint adds
the optimizer's flat state buffers and where training stood (epoch, step, seed), so a resumed
run continues the same sequence of shuffles and learning rates.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from xpnn.errors import UserError


def atomic_savez(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """Write to a temporary file beside ``path`` and rename: a crash never leaves half a file."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise UserError(f"{path}: directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_params(path: str | os.PathLike, params: dict[str, np.ndarray]) -> None:
    """``--save``: host arrays under their stable names (``layer0.W``...)."""
    atomic_savez(path, params)


def checkpoint_path(directory: str | os.PathLike, epoch: int) -> Path:
    return Path(directory) / f"checkpoint-epoch{epoch:04d}.npz"


def save_checkpoint(
    directory: str | os.PathLike, model: Any, optimizer: Any, epoch: int, seed: int
) -> Path:
    to_host = model.backend.to_host
    arrays = {name: to_host(p) for name, p in model.named_params().items()}
    arrays.update({f"optim.{k}": to_host(v) for k, v in optimizer.state.items()})
    arrays["meta.epoch"] = np.array(epoch)
    arrays["meta.step"] = np.array(optimizer.step_count)
    arrays["meta.seed"] = np.array(seed)
    Path(directory).mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(directory, epoch)
    atomic_savez(path, arrays)
    return path


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    found = sorted(
        p
        for p in Path(directory).glob("checkpoint-epoch*.npz")
        if re.fullmatch(r"checkpoint-epoch\d+\.npz", p.name)
    )
    return found[-1] if found else None


def load_checkpoint(
    path: Path, model: Any, optimizer: Any, restore_arrays: bool = True
) -> tuple[int, int]:
    """Restore parameters and optimizer state in place; returns (epochs done, steps done).

    ``restore_arrays=False`` checks the file and restores only the step count: for ranks whose
    buffers another rank of the node fills (shared memory)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: not a readable checkpoint ({exc})") from None
    xp = model.xp
    for name, param in model.named_params().items():
        if name not in arrays or arrays[name].shape != tuple(param.shape):
            raise UserError(f"{path}: parameter {name} missing or of another shape than the model")
        if restore_arrays:
            param[...] = model.backend.asarray(arrays[name], dtype=param.dtype)
    for key, buf in optimizer.state.items():
        if f"optim.{key}" not in arrays or arrays[f"optim.{key}"].shape != tuple(buf.shape):
            raise UserError(f"{path}: optimizer state {key} missing (another --optimizer?)")
        if restore_arrays:
            buf[...] = xp.asarray(model.backend.asarray(arrays[f"optim.{key}"], dtype=buf.dtype))
    optimizer.step_count = int(arrays["meta.step"])
    return int(arrays["meta.epoch"]), int(arrays["meta.step"])
