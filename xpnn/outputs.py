"""The files a run writes, checked before it trains: a bad place fails at the start."""

import glob
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from xpnn.errors import UserError, path_problems
from xpnn.record.files import open_to_write, same_file
from xpnn.runtime import lock
from xpnn.train.checkpoint import CHECKPOINT_NAME, no_resume, refuse_other_runs, remove_unfinished
from xpnn.train.metrics_file import check_metrics_file


def _takes_files(param: str, path: str, directory: Path) -> None:
    """A throwaway file proves ``directory`` can be written, before the training, not after."""
    with path_problems(param, path, f"cannot create files in {directory}"):
        tempfile.TemporaryFile(dir=directory).close()


def _writable_file(
    param: str, path: str | None, writer: bool, made: str | None = None, appended: bool = False
) -> None:
    """``made``: the checkpoint dir this run creates; ``appended`` (metrics): no pipe."""
    if path is None:
        return
    at = f"`{param}` {path}"
    with path_problems(param, path):
        if os.path.islink(path) and os.lstat(path).st_uid != os.geteuid():
            why = "a symbolic link of another user; xpnn writes no file through it"
            raise UserError(f"{at}: {why}")
        parent = Path(path).resolve().parent
        in_checkpoints = made is not None and parent == Path(made).resolve()
        there = Path(path).stat().st_mode if Path(path).exists() else None
        if there is None and parent.exists() and not parent.is_dir():
            raise UserError(f"{at}: {Path(path).parent} is not a directory")
        if there is None and not parent.is_dir() and not in_checkpoints:
            raise UserError(f"{at}: directory {Path(path).parent} does not exist")
        if there is not None and stat.S_ISDIR(there):
            raise UserError(f"{at}: is a directory; give a file name")
        if there is not None and not appended and not stat.S_ISREG(there):
            raise UserError(f"{at}: exists and is not a regular file")
        if there is not None and (stat.S_ISFIFO(there) or stat.S_ISSOCK(there)):
            raise UserError(f"{at}: is a pipe or a socket; give a file name")
        if in_checkpoints and CHECKPOINT_NAME.fullmatch(Path(path).name):
            raise UserError(f"{at}: a name `checkpoint_dir` uses for the run's checkpoints")
    if not writer:
        return
    if there is None or stat.S_ISREG(there):  # a device is written in place: nothing is made
        _takes_files(param, path, parent)
    if not appended and parent.is_dir():  # --save: what a killed run left of its file
        with path_problems(param, path):
            remove_unfinished(parent, glob.escape(Path(path).name))
    if appended and there is not None:  # a read-only file in a writable directory
        with path_problems(param, path, "cannot write to it"):
            os.close(open_to_write(path, os.O_APPEND))


def _checkpoint_dir(path: str | None, writer: bool, resume: bool | str) -> None:
    """Made now by the rank that writes into it, so that a bad place fails before training."""
    if path is None:
        return
    with path_problems("checkpoint_dir", path):
        if Path(path).exists() and not Path(path).is_dir():
            raise UserError(f"`checkpoint_dir` {path}: exists and is not a directory")
        if resume is True and not Path(path).exists():  # a typo: not made, then refused
            raise UserError(no_resume(path))
        if not writer:
            return
    with path_problems("checkpoint_dir", path, "cannot create the directory"):
        Path(path).mkdir(parents=True, exist_ok=True)
    _takes_files("checkpoint_dir", path, Path(path))
    with path_problems("checkpoint_dir", path):
        lock.hold(path)  # first: what is in the directory is this job's only once it is held
        if not resume:
            refuse_other_runs(path)
        remove_unfinished(path)


def _not_an_input(param: str, path: str | None, spec: Any) -> None:
    """A run never replaces a file it reads: ``--save corpus.txt`` would lose the corpus."""
    if path is None or not os.path.exists(path):
        return
    inputs = []  # (parameter, path) of each file the run reads that a user names
    model = spec.model if isinstance(spec.model, str) else ""
    if ".py:" in model:
        inputs.append(("model", model.rsplit(":", 1)[0]))
    with path_problems(param, path):
        data = getattr(spec, "data_dir", None)
        if data and os.path.isdir(data):
            inputs += [("data_dir", os.path.join(data, n)) for n in sorted(os.listdir(data))]
        elif data:
            inputs.append(("data_dir", data))
        for source, read in inputs:
            if same_file(path, read):
                why = f"a file this run reads (`{source}` {read}); give another file name"
                raise UserError(f"`{param}` {path}: {why}")


def check_paths(spec: Any, writer: bool) -> None:
    """What the run will write, the directory first: ``save`` may name a file in it."""
    _not_an_input("save", spec.save, spec)
    _not_an_input("metrics", spec.metrics, spec)
    _checkpoint_dir(spec.checkpoint_dir, writer, spec.resume)
    _writable_file("metrics", spec.metrics, writer, made=spec.checkpoint_dir, appended=True)
    if writer and spec.metrics:  # a fresh run empties it, a resume appends: only to metrics
        with path_problems("metrics", spec.metrics):
            if not os.path.exists(spec.metrics) or os.path.isfile(spec.metrics):
                lock.hold_metrics(spec.metrics)  # not /dev/null: every job may write there
            check_metrics_file(spec.metrics)
    _writable_file("save", spec.save, writer, made=spec.checkpoint_dir)
    if spec.save and spec.metrics and Path(spec.save).resolve() == Path(spec.metrics).resolve():
        raise UserError(f"`save` {spec.save}: the same file as `metrics`")
