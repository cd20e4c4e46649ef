"""Where a run starts: ``checkpoint_dir`` locked; with ``resume``, its latest checkpoint read."""

import os
from typing import TYPE_CHECKING

from xpnn.errors import UserError, path_problems
from xpnn.runtime import lock
from xpnn.train import checkpoint, midepoch

if TYPE_CHECKING:
    from xpnn.train.trainer import Trainer


def start(trainer: "Trainer", directory: str | None, resume: bool | str) -> None:
    """Sets ``trainer.start_epoch`` and ``resume_note``; a misfit is every rank's UserError."""
    if not directory:
        return
    if trainer.is_root:  # one job a directory (the command line took it first)
        with path_problems("checkpoint_dir", directory):
            os.makedirs(directory, exist_ok=True)
            lock.hold(directory)
    if not resume:  # the command line checked it before
        with path_problems("checkpoint_dir", directory):
            checkpoint.refuse_other_runs(directory)
        return
    cfg = trainer.cfg
    path = checkpoint.latest_checkpoint(directory)
    # A directory on each node's own disk would resume ranks from different epochs.
    seen = trainer.comm.allgather_obj(path.name if path else None)
    if len(set(seen)) > 1:
        found = ", ".join(f"rank {r}: {name or 'none'}" for r, name in enumerate(seen))
        why = "every rank must see the same directory (a file system shared by all nodes)"
        where = f"`checkpoint_dir` {directory}: the ranks find different latest checkpoints"
        raise UserError(f"{where} ({found}); {why}")
    if path is None and resume != "auto":
        raise UserError(no_checkpoint(directory))
    if path is None:
        trainer.resume_note = f"resume: no checkpoint in {directory}, starting afresh"
        return
    try:
        epoch, step, said = checkpoint.load_checkpoint(path, trainer)
    except checkpoint.DamagedCheckpoint as exc:  # the one before it may be whole: say so
        if older := checkpoint.checkpoints(directory)[-2:-1]:
            why = f"{older[0].name}, remains: move this one away to resume from it"
            raise checkpoint.DamagedCheckpoint(f"{exc}; the one before it, {why}") from None
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
        trainer.progress = midepoch.EpochProgress(partial, trainer.batches_done() // per_epoch)


def no_checkpoint(directory: str | os.PathLike) -> str:
    hint = "check the directory, or give `resume` auto to start afresh where there is none"
    return f"`checkpoint_dir` {directory}: no checkpoint to resume from; {hint}"
