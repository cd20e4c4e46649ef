"""Checkpoints: ``.npz`` files of the whole network, resumed on other ranks or layouts; where a
run starts: its checkpoint directory locked, its latest checkpoint read with ``resume``."""

import errno
import json
import os
import re
import stat
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from xpnn.data.files import memory_bytes
from xpnn.errors import UserError, path_problems
from xpnn.parallel.model.whole import own_piece, whole_shapes, whole_size
from xpnn.record.files import whole_file
from xpnn.record.timeline import number, numbers
from xpnn.runtime import lock
from xpnn.runtime.segments import files_in_use


def atomic_savez(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> None:
    """``np.savez`` by ``whole_file``; this user's link is followed, another user's refused."""
    if os.path.islink(path) and os.lstat(path).st_uid != os.geteuid():
        raise UserError(f"{path}: a symbolic link of another user; xpnn writes no file through it")
    path = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
    if path.parent and not path.parent.exists():
        raise UserError(f"{path}: directory {path.parent} does not exist")
    with whole_file(path) as fh:
        np.savez(fh, **arrays)
        fault = os.environ.get("XPNN_SAVE_FAULT", "")  # the fault tests': ``sleep:S``, ``enospc``
        if fault == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if fault.startswith("sleep:"):  # a pause mid-write
            time.sleep(float(fault.removeprefix("sleep:")))


CHECKPOINT_NAME = re.compile(r"checkpoint-epoch(\d+)(?:-step(\d+))?\.npz")  # -step: mid-epoch
TEMPORARY_NAME = re.compile(r".+\.[a-z0-9_]{8}\.tmp")  # atomic_savez's: mkstemp's 8 characters


def save_checkpoint(
    directory: str | os.PathLike,
    params: dict[str, np.ndarray],
    state: dict[str, dict[str, np.ndarray]],
    epoch: int,
    step: int,
    seed: int,
    dataset: str = "",
    **said: dict[str, Any] | None,
) -> Path:
    """``params``, optimizer ``state`` (state -> name -> array) and ``said`` as JSON: one file."""
    arrays = dict(params)
    arrays |= {f"optim.{name}.{key}": a for name, kept in state.items() for key, a in kept.items()}
    meta = {"epoch": epoch, "step": step, "seed": seed, "dataset": dataset or None}
    arrays |= {f"meta.{k}": np.array(v) for k, v in meta.items() if v is not None}
    arrays |= {f"meta.{k}": np.array(json.dumps(v, sort_keys=True)) for k, v in said.items() if v}
    Path(directory).mkdir(parents=True, exist_ok=True)
    mid = f"-step{step:08d}" if said.get("partial") else ""
    path = Path(directory) / f"checkpoint-epoch{epoch:04d}{mid}.npz"
    atomic_savez(path, arrays)
    return path


def refuse_other_runs(directory: str | os.PathLike) -> None:
    if Path(directory).is_dir() and (found := latest_checkpoint(directory)) is not None:
        hint = "add `resume` to continue it, or give an empty directory"
        why = f"holds another run's checkpoints ({found.name}); {hint}"
        raise UserError(f"`checkpoint_dir` {directory}: {why}")


def remove_unfinished(
    directory: str | os.PathLike, name: str = "checkpoint-epoch*.npz"
) -> list[Path]:
    """Delete the ``.tmp`` files ``whole_file`` left of ``name`` that no process holds open."""
    found = sorted(Path(directory).glob(f"{name}.*.tmp"))
    if left := [path for path in found if TEMPORARY_NAME.fullmatch(path.name)]:
        used = files_in_use()
        left = [path for path in left if str(path.resolve()) not in used]
    for path in left:
        path.unlink(missing_ok=True)
    return left


def checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The checkpoints in ``directory``, oldest first (by number: 10000 after 9999)."""
    found = {}
    for p in Path(directory).glob("checkpoint-epoch*.npz"):
        if match := CHECKPOINT_NAME.fullmatch(p.name):
            found[int(match.group(1)), int(match.group(2) or -1)] = p
    return [found[key] for key in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    return next(reversed(checkpoints(directory)), None)


KEEP_CHECKPOINTS = 2  # the newest, and one before it in case the newest is damaged


def prune_checkpoints(directory: str | os.PathLike, keep: int) -> list[Path]:
    """Delete and return all but the ``keep`` (>= 0) newest checkpoints (0: none)."""
    doomed = checkpoints(directory)[:-keep] if keep else []
    for path in doomed:
        path.unlink(missing_ok=True)
    return doomed


class DamagedCheckpoint(UserError):
    """No checkpoint xpnn could have written (not another run's): the one before may do."""


def damaged(path: Any, why: Any, what: str = "damaged checkpoint") -> DamagedCheckpoint:
    return DamagedCheckpoint(f"{path}: {what} ({why})")


MOST_EPOCHS = 2**31 - 1  # the most ``--epochs`` takes: a run never writes a later epoch


def read_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every array of ``path``, never unpickling, nor reading a device, a pipe or past memory."""
    info = os.stat(path)  # FileNotFoundError is the caller's to word
    if not stat.S_ISREG(info.st_mode):
        raise damaged(path, "not a regular file", "not an xpnn checkpoint")
    try:
        if (have := memory_bytes()) is not None and info.st_size > have:
            raise MemoryError(f"{info.st_size:,} bytes, more than this machine's memory")
        if not zipfile.is_zipfile(path):
            with open(path, "rb") as fh:
                if fh.read(4) != b"PK\x03\x04":  # not even the start of a zip archive
                    raise damaged(path, "not an .npz file", "not an xpnn checkpoint")
            raise ValueError("cut short or damaged")
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, MemoryError) as exc:
        if "pickle" in str(exc):  # an object array inside the archive
            exc = "holds pickled objects, which are never loaded"
        elif isinstance(exc, MemoryError) and not str(exc):  # a header that claims terabytes
            exc = "an array larger than this machine's memory"
        raise damaged(path, exc, "not a readable checkpoint") from None


def _meta(path: Path, arrays: dict[str, np.ndarray], name: str) -> int:
    """``meta.<name>``: a whole number (>= 0 but for the seed), or the file is damaged."""
    if (value := arrays.get(f"meta.{name}")) is None:
        raise UserError(f"{path}: not an xpnn checkpoint (no meta.{name})")
    if value.shape != () or value.dtype.kind not in "iu" or (name != "seed" and int(value) < 0):
        raise damaged(path, f"meta.{name} is {value.tolist()!r}")
    if name == "epoch" and int(value) > MOST_EPOCHS:
        why = f"meta.epoch is {int(value)}, past the most --epochs a run takes, {MOST_EPOCHS}"
        raise damaged(path, why)
    return int(value)


def check_finite(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Every parameter and optimizer state must be finite, or a resume would blame the rate."""
    for key, value in arrays.items():
        if not key.startswith("meta.") and value.dtype.kind == "f" and not np.isfinite(value).all():
            bad = int(value.size - np.count_nonzero(np.isfinite(value)))
            raise damaged(path, f"{key} holds {bad:,} value(s) that are NaN or infinite")


def _same_run(path: Path, arrays: dict[str, np.ndarray], trainer: Any) -> tuple[int, int]:
    """The file's (epoch, step), once its run is shown to be ``trainer``'s."""
    steps_per_epoch, dataset = trainer.steps_per_epoch, trainer.data.name
    epoch, step, stored_seed = (_meta(path, arrays, k) for k in ("epoch", "step", "seed"))
    scaled = checked_meta(path, arrays, "loss_scale")
    skipped = scaled["skipped"] if scaled else 0  # fp16: steps whose update overflowed
    if step + skipped < epoch:  # every epoch makes at least one step
        raise damaged(path, f"meta.step {step} is fewer than meta.epoch {epoch}")
    stored = arrays.get("meta.dataset")
    if stored is not None and (stored.shape != () or stored.dtype.kind != "U"):
        raise damaged(path, f"meta.dataset is {stored.tolist()!r}")
    if dataset and stored is not None and str(stored) != dataset:
        why = f"{path}: written by a run on {stored}, this one is on {dataset} (`dataset`)"
        raise UserError(why)
    done = step + skipped  # batches trained
    mid = "meta.partial" in arrays  # written mid-epoch: some of the next epoch's steps made
    guess = "(another global batch, `replicate` or data set?)"
    this = f"this one makes {steps_per_epoch} an epoch {guess}"
    if mid and done // steps_per_epoch != epoch:
        why = f"made {done} steps, {epoch} epoch(s) and part of the next"
        raise UserError(f"{path}: written by a run that {why}, {this}")
    if not mid and done != epoch * steps_per_epoch:
        why = f"made {step} steps in {epoch} epoch(s)"
        raise UserError(f"{path}: written by a run that {why}, {this}")
    stored_identity = {"seed": stored_seed} | _json_meta(path, arrays, "identity")
    identity = {"seed": trainer.cfg.seed} | trainer.identity()
    for key in sorted(stored_identity.keys() & identity.keys()):
        if stored_identity[key] != identity[key]:
            what, hint = IDENTITY_WORDS.get(key, (f"--{key}", ""))
            was, now = stored_identity[key], identity[key]
            why = f"written by a run with {what} {was}, this one has {what} {now}{hint}"
            raise UserError(f"{path}: {why}")
    return epoch, step


IDENTITY_WORDS = {  # how a resume's refusal names an entry of ``meta.identity``, and whence
    "global_batch": ("global batch", " (`batch_size`, or `per_rank_batch` x ranks)"),
    "train_samples": ("training set size", " (`synthetic_size`, `replicate` or data set)"),
    "seed": ("`seed`", ""),
}


def load_checkpoint(path: Path, trainer: Any) -> tuple[int, int, dict[str, Any]]:
    """Restore this rank's part of ``trainer``'s run from ``path``: (epochs, steps, its JSON)."""
    model, optimizer, arrays = trainer.model, trainer.optimizer, read_npz(path)
    if any(key.count(".") == 1 for key in arrays if key.startswith("optim.")):
        why = "one flat buffer per optimizer state, before checkpoints named the state per"
        why = f"{path}: written by an older xpnn ({why} parameter)"
        raise UserError(f"{why}; resume it with that version")
    epoch, step = _same_run(path, arrays, trainer)
    targets = [("", "parameter", "", model.named_views(model.params))]
    targets += [
        (f"optim.{state}.", "optimizer state", " (another `optimizer`?)", model.named_views(buf))
        for state, buf in optimizer.state.items()
    ]
    shapes = whole_shapes(model)
    for prefix, what, hint, _ in targets:  # what this rank holds: each array there, as big
        for key, shape in shapes.items():
            stored = arrays.get(prefix + key)
            if stored is None or stored.shape != shape:
                why = f"{what} {prefix}{key} missing or of another shape than the model{hint}"
                raise UserError(f"{path}: {why}")
            if stored.dtype.kind != "f":  # strings, complex, booleans: the file is damaged
                why = f"{prefix}{key} holds {stored.dtype} values, not floating point"
                raise damaged(path, why)
    check_finite(path, arrays)
    for key, value in arrays.items():
        if key.startswith("optim.v.") and (value < 0).any():
            adam = "Adam's second moment (a mean of squared gradients)"
            raise damaged(path, f"{key} holds negative values, where {adam} is never below 0")
    # and nothing more: a layer or an optimizer state that the network does not have
    stored = sum(v.size for k, v in arrays.items() if not k.startswith(("optim.", "meta.")))
    if stored != whole_size(model):
        why = f"holds {stored:,} parameters, the network has {whole_size(model):,}"
        raise UserError(f"{path}: {why} (another `hidden` or `model`?)")
    states = sorted({k.split(".")[1] for k in arrays if k.startswith("optim.")})
    if states != sorted(optimizer.state):
        found, keeps = (", ".join(names) or "none" for names in (states, sorted(optimizer.state)))
        why = f"optimizer state {found}, but this `optimizer` keeps {keeps}"
        raise UserError(f"{path}: {why} (another `optimizer`?)")
    if trainer.update.restores_checkpoint:  # else a node's other rank fills the buffers
        for prefix, _, _, views in targets:
            for key, view in views.items():
                piece = own_piece(model, key, arrays[prefix + key])
                view[...] = model.backend.asarray(piece, dtype=view.dtype)
    optimizer.step_count = step
    said = {name: checked_meta(path, arrays, name) for name in CHECKED}
    return epoch, step, said | {"settings": _json_meta(path, arrays, "settings")}


def _json_meta(path: Path, arrays: dict[str, np.ndarray], name: str) -> dict[str, Any]:
    """``meta.<name>``: a JSON object in a string ({} where there is none), or damaged."""
    if (stored := arrays.get(f"meta.{name}")) is None:
        return {}
    try:
        value = json.loads(str(stored)) if stored.shape == () else None
    except ValueError:
        value = None
    if stored.dtype.kind != "U" or not isinstance(value, dict):
        raise damaged(path, f"meta.{name} is {stored.tolist()!r}")
    return value


def count(value: Any) -> bool:
    return type(value) is int and value >= 0  # a JSON number: int or float, never a subclass


CHECKED = {  # the JSON entries a resume reads, each checked
    "loss_scale": {"scale": lambda v: number(v) and v > 0, "good_steps": count, "skipped": count},
    "partial": {  # ``midepoch.partial_of``'s
        "kind": lambda v: v in ("epoch", "steps"),
        "sums": lambda v: isinstance(v, list) and all(numbers(row, 2) for row in v),
        "seconds": number,
        "sent": lambda v: numbers(v, 2),
        "samples": count,
        "steps": count,
    },
}


def checked_meta(path: Any, arrays: dict[str, np.ndarray], name: str) -> dict | None:
    """``meta.<name>`` of checkpoint ``path`` (None: none), each entry passing its check."""
    checks = CHECKED[name]
    if f"meta.{name}" not in arrays:
        return None
    value = _json_meta(path, arrays, name)
    for key in sorted(value.keys() | checks.keys()):
        if key not in checks or not checks[key](value.get(key)):
            raise damaged(path, f"meta.{name}'s {key} is {value.get(key)!r}")
    return value


def start(trainer: Any, directory: str | None, resume: bool | str) -> None:
    """Sets ``trainer.start_epoch`` and ``resume_note``; a misfit is every rank's UserError."""
    if not directory:
        return
    if trainer.is_root:  # one job a directory (the command line took it first)
        with path_problems("checkpoint_dir", directory):
            os.makedirs(directory, exist_ok=True)
            lock.hold(directory)
    if not resume:  # the command line checked it before
        with path_problems("checkpoint_dir", directory):
            refuse_other_runs(directory)
        return
    cfg = trainer.cfg
    path = latest_checkpoint(directory)
    # A directory on each node's own disk would resume ranks from different epochs.
    seen = trainer.comm.allgather_obj(path.name if path else None)
    if len(set(seen)) > 1:
        found = ", ".join(f"rank {r}: {name or 'none'}" for r, name in enumerate(seen))
        why = "every rank must see the same directory (a file system shared by all nodes)"
        where = f"`checkpoint_dir` {directory}: the ranks find different latest checkpoints"
        raise UserError(f"{where} ({found}); {why}")
    if path is None and resume != "auto":
        raise UserError(no_resume(directory))
    if path is None:
        trainer.resume_note = f"resume: no checkpoint in {directory}, starting afresh"
        return
    try:
        epoch, step, said = load_checkpoint(path, trainer)
    except DamagedCheckpoint as exc:  # the one before it may be whole: say so
        if older := checkpoints(directory)[-2:-1]:
            why = f"{older[0].name}, remains: move this one away to resume from it"
            raise DamagedCheckpoint(f"{exc}; the one before it, {why}") from None
        raise
    done, scale = "", trainer.loss_scale
    if scale is not None:  # this run scales: the checkpoint's scale, or a fresh one
        if (stored := said["loss_scale"]) is None:
            done = f"; the loss scale starts at {scale.scale:g} (the checkpoint has none)"
        else:
            scale.restore(stored)
    if cfg.steps is not None:  # training by steps: its count is what is reached
        done += f"; `steps` {cfg.steps} reached, nothing to train" if step >= cfg.steps else ""
    elif epoch >= cfg.epochs:
        done += f"; `epochs` {cfg.epochs} reached, nothing to train"
    now, before = trainer.settings(), said["settings"]  # what both runs name, changed:
    changed = [f"`{k}` {v} -> {now[k]}" for k, v in sorted(before.items()) if now.get(k, v) != v]
    since = f"; changed since: {', '.join(changed)}" if changed else ""
    trainer.resume_note = f"resume: {path} (epoch {epoch}, step {step}){since}{done}"
    trainer.start_epoch, per_epoch = epoch, trainer.steps_per_epoch
    partial = said["partial"]  # a mid-epoch checkpoint's sums, of this run's kind
    if partial is not None and partial["kind"] == ("epoch" if cfg.steps is None else "steps"):
        progress = trainer.progress  # the span under way carries on from the checkpoint's sums
        progress.restored, progress.restored_epoch = partial, trainer.batches_done() // per_epoch


def no_resume(directory: str | os.PathLike) -> str:
    hint = "check the directory, or give `resume` auto to start afresh where there is none"
    return f"`checkpoint_dir` {directory}: no checkpoint to resume from; {hint}"
