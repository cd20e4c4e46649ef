"""Saved parameters and checkpoints: plain ``.npz`` files, written atomically.

``--save`` writes every parameter under its stable name (``layer0.W``...); a checkpoint adds
the optimizer's state under the same names (``optim.m.layer0.W``...) and where training stood
(epoch, step, seed), so a resumed run continues the same sequence of shuffles, dropout masks
and learning rates. Both hold the whole network, whatever parallelism wrote them: a run may
resume on another number of ranks, or with another ``--parallel``.
"""

from __future__ import annotations

import os
import re
import tempfile
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from xpnn.errors import UserError
from xpnn.parallel.whole import own_piece, whole_shape


def atomic_savez(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """Write to a temporary file beside ``path`` and rename: a crash never leaves half a file."""
    path = Path(path)
    if path.parent and not path.parent.exists():
        raise UserError(f"{path}: directory {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp's 0600 would hide it from the user's group
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_params(path: str | os.PathLike, params: dict[str, np.ndarray]) -> None:
    """``--save``: host arrays under their stable names (``layer0.W``...)."""
    atomic_savez(path, params)


def checkpoint_path(directory: str | os.PathLike, epoch: int) -> Path:
    return Path(directory) / f"checkpoint-epoch{epoch:04d}.npz"


def save_checkpoint(
    directory: str | os.PathLike,
    params: dict[str, np.ndarray],
    state: dict[str, dict[str, np.ndarray]],
    epoch: int,
    step: int,
    seed: int,
) -> Path:
    """Write the whole network's ``params`` and optimizer ``state`` (state name -> parameter
    name -> array, e.g. ``optim.m.layer0.W``): host arrays, whole whatever the parallelism."""
    arrays = dict(params)
    for state_name, named in state.items():
        arrays.update({f"optim.{state_name}.{key}": value for key, value in named.items()})
    arrays["meta.epoch"] = np.array(epoch)
    arrays["meta.step"] = np.array(step)
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
    """Restore this rank's part of the parameters and optimizer state in place; returns
    (epochs done, steps done).

    ``restore_arrays=False`` checks the file and restores only the step count: for ranks whose
    buffers another rank of the node fills (shared memory)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise UserError(f"{path}: not a readable checkpoint ({exc})") from None
    if "meta.step" not in arrays or "meta.epoch" not in arrays:
        raise UserError(f"{path}: not an xpnn checkpoint (no meta.epoch / meta.step)")
    if any(key.count(".") == 1 for key in arrays if key.startswith("optim.")):
        raise UserError(
            f"{path}: written by an older xpnn (one flat buffer per optimizer state, before "
            "checkpoints named the state per parameter); resume it with that version"
        )
    targets = [("", "parameter", "", model.named_params())]
    targets += [
        (f"optim.{state}.", "optimizer state", " (another --optimizer?)", model.named_views(buf))
        for state, buf in optimizer.state.items()
    ]
    for prefix, what, hint, views in targets:
        for key, layer, name in model.param_names():
            stored = arrays.get(prefix + key)
            if stored is None or stored.shape != whole_shape(layer, name):
                raise UserError(
                    f"{path}: {what} {prefix}{key} missing or of another shape than the model{hint}"
                )
            if restore_arrays:
                view = views[key]
                view[...] = model.backend.asarray(own_piece(layer, name, stored), dtype=view.dtype)
    optimizer.step_count = int(arrays["meta.step"])
    return int(arrays["meta.epoch"]), int(arrays["meta.step"])
