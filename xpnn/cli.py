"""Command line: ``python -m xpnn [train] [flags]`` and ``python -m xpnn info``.

The flags fill a ``RunSpec`` (``xpnn.run``), which the library builds into a run; here are only
what a command line adds: its flags, the checks of the paths it is given, the flag named where
the library names a parameter (`` `batch_size` `` is ``--batch-size``), and the exit codes.

Exit codes (the contract): 0 success; 2 a user error, printed as one line naming the flag or file;
1 anything else. Under ``mpiexec`` every rank parses the same flags, so a flag error is printed
by rank 0 only; errors found while setting up are agreed on by all ranks and printed once; a
failure during training aborts the whole MPI job.
"""

from __future__ import annotations

import argparse
import math
import stat
import sys
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from xpnn.errors import PARAM, UserError, path_problems, user_message, worded
from xpnn.run import MICROBATCHES, SYNTHETIC_SIZE, RunSpec
from xpnn.runtime.world import launch_rank

__all__ = ["FLAGS", "build_parser", "flag_words", "main", "to_spec"]  # what scripts may use


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line naming it (``--epochs: must be at least 1,
    got 0``; no usage dump) so it fits the contract."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _ArgError(message.removeprefix("argument "))


MOST = 2**31 - 1  # counts and sizes past this are typos, and past NumPy's or C's int types


def _positive_int(most: int = MOST):  # noqa: ANN202
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not 1 <= value <= most:
            bound = "at least 1" if value < 1 else f"at most {most}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def _whole_number(most: int = MOST):  # noqa: ANN202
    """An integer from 0 to ``most`` (0 meaning none or off, as the flag says)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if not 0 <= value <= most:
            raise argparse.ArgumentTypeError(f"must be from 0 to {most}, got {value}")
        return value

    return parse


def _hidden(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(t) for t in text.split(","))  # "16,,8" is a typo, not "16,8"
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected sizes like 512,256, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    if max(sizes) > MOST:
        raise argparse.ArgumentTypeError(f"sizes must be at most {MOST}, got {text!r}")
    return sizes


def _path(text: str) -> str:
    """A file or directory name; an empty one is a slip (the shell's ``--save $UNSET``)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path")
    return text


def _float_from(low: float, inclusive: bool = True, most: float = math.inf):  # noqa: ANN202
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (value >= low if inclusive else value > low):  # also refuses nan
            bound = f">= {low:g}" if inclusive else f"> {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        if math.isinf(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text}")
        if value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most:.10g}, got {text}")
        return value

    return parse


SEED_END = 2**64  # a checkpoint keeps the seed as a 64-bit integer (NumPy's uint64)


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value < SEED_END:
        raise argparse.ArgumentTypeError(f"must be from 0 to 2**64 - 1, got {value}")
    return value


def build_info_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m xpnn info", description="What this machine offers to xpnn.")
    p.add_argument("--json", action="store_true", help="machine-readable")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The flags, one per ``RunSpec`` field (``--no-progress`` for ``progress``), whose
    defaults are ``RunSpec``'s."""
    p = _Parser(
        prog="python -m xpnn",
        usage="python -m xpnn [train] [flags]  |  python -m xpnn info [--json]",
        description="Train a network over xp, alone or under MPI (mpiexec -n N python -m xpnn "
        "...). `python -m xpnn info` says what this machine offers: backends, devices, cores, "
        "the MPI library and whether it is CUDA-aware.",
    )
    a, count = p.add_argument, _positive_int()
    a(
        "--backend",
        choices=["numpy", "numba", "cupy", "auto"],
        help="array library (default numpy); numba adds compiled CPU kernels; auto: cupy where "
        "a GPU is usable, else numba",
    )
    a("--model", choices=["mlp", "cnn"], help="(default mlp)")
    a("--hidden", type=_hidden, help="MLP hidden sizes (default 512,256)")
    a("--activation", choices=["relu", "sigmoid", "tanh"], help="MLP (relu)")
    a(
        "--loss",
        choices=["softmax_cross_entropy", "sigmoid_bce"],
        help="softmax_cross_entropy (default) or sigmoid_bce (one-vs-rest logistic losses)",
    )
    a("--dataset", choices=["mnist", "fashion-mnist", "synthetic"], help="(default fashion-mnist)")
    a("--data-dir", type=_path, help="directory holding the four IDX files")
    a(
        "--replicate",
        type=count,
        help="repeat the training set K times (scaling studies; default 1)",
    )
    a(
        "--synthetic-size",
        type=count,
        help=f"--dataset synthetic: training samples ({SYNTHETIC_SIZE:,})",
    )
    a("--epochs", type=count, help="(default 5)")
    a("--batch-size", help="GLOBAL batch size (128), or 'full' for full-batch GD")
    a("--per-rank-batch", type=count, help="batch per rank; the global batch is this x the ranks")
    a("--lr", type=_float_from(0.0, inclusive=False), help="(default 0.001)")
    a(
        "--lr-scaling",
        choices=["none", "linear"],
        help="linear: multiply --lr by the number of ranks (Goyal et al.; default none)",
    )
    a(
        "--warmup-epochs",
        # past this the warmup's steps (epochs x steps an epoch) overflow a 64-bit count
        type=_float_from(0.0, most=MOST),
        help="raise the rate linearly from ~0 to --lr over E epochs (default 0)",
    )
    a(
        "--schedule",
        choices=["constant", "step", "cosine"],
        help="step: x0.1 every --step-epochs epochs; cosine: half a cosine towards 0 "
        "(default constant)",
    )
    a("--step-epochs", type=count, help="--schedule step: epochs between decays (--epochs / 3)")
    a("--optimizer", choices=["sgd", "momentum", "adam"], help="(default adam)")
    a("--dtype", choices=["float32", "float64"], help="(default float32)")
    a("--seed", type=_seed, help="initial weights, shuffles and dropout masks (default 0)")
    a(
        "--threads",
        type=_positive_int(most=4096),  # past a few thousand, BLAS libraries overflow or crawl
        help="BLAS/Numba threads per rank (default: the cores it may run on, shared with the "
        "node's ranks that may run on them too)",
    )
    a("--metrics", type=_path, help="JSON-lines metrics file (rank 0 writes it)")
    a("--save", type=_path, help="save parameters to FILE.npz at the end")
    a("--checkpoint-dir", type=_path)
    a("--resume", action="store_true", help="continue from the latest checkpoint")
    a(
        "--keep-checkpoints",
        type=_whole_number(),
        metavar="K",
        help="keep the newest K checkpoints, deleting older ones once a new one is complete "
        "(default 2; 0 keeps every one)",
    )
    a(
        "--comm",
        choices=["auto", "mpi-shm", "mpi-host", "mpi-cuda", "nccl"],
        help="how ranks exchange gradients (default auto: the fastest that works here)",
    )
    a(
        "--bucket-mb",
        # below ~1 kB a bucket is an allreduce per few values: a step takes seconds
        type=_float_from(0.001, most=2**20),  # a TB bucket is a typo
        help="allreduce bucket size in MB (default 25; mpi-host and the GPU comms)",
    )
    a(
        "--stall-warn",
        type=_float_from(0.0, most=MOST),
        metavar="S",
        help="say where a rank waits once it has waited S seconds for the others in one "
        "exchange (default 60; 0: never)",
    )
    a(
        "--stall-abort",
        type=_float_from(0.0, most=MOST),
        metavar="S",
        help="end the job (exit 124) once a rank has waited S seconds in one exchange, naming "
        "the ranks that waited (default 0: never; e.g. 600 on a cluster)",
    )
    a(
        "--node-share",
        choices=["auto", "gradients", "activations"],
        help="mpi-shm: what the ranks of a node share, their gradients (summed by the update) "
        "or the batch's activations (each rank computes some rows of every gradient; MLPs "
        "only); auto (default): activations when they are fewer values than the parameters",
    )
    a(
        "--parallel",
        choices=["data", "tensor", "pipeline"],
        help="data: each rank a share of every batch; tensor: each rank a slice of every "
        "pair of Dense layers (MLP only); pipeline: each rank a run of consecutive layers "
        "(default data)",
    )
    a(
        "--model-ranks",
        type=count,
        help="--parallel tensor/pipeline: ranks that hold one replica of the network (default: "
        "all); N ranks train N / K replicas data-parallel (2-D parallelism)",
    )
    a(
        "--microbatches",
        type=count,
        help=f"--parallel pipeline: micro-batches per global batch (default {MICROBATCHES})",
    )
    a(
        "--pipeline-schedule",
        choices=["gpipe", "1f1b"],
        help="--parallel pipeline: gpipe (all forwards, then all backwards; the default) or "
        "1f1b (a forward and a backward in turn: activations of at most stages - s "
        "micro-batches held, not M)",
    )
    a(
        "--recompute",
        action="store_true",
        help="--parallel pipeline: keep each micro-batch's stage input, not its activations, "
        "and run its forward again before its backward (less memory, one more forward)",
    )
    a("--no-progress", action="store_true", help="no progress bar even on a terminal")
    p.set_defaults(**{f.name: getattr(RunSpec, f.name) for f in fields(RunSpec)})
    return p


def _takes_files(param: str, path: str, directory: Path) -> None:
    """A throwaway file proves ``directory`` can be written: permissions, read-only mounts and
    pseudo file systems (/proc, /sys) all show up here instead of after the training."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise UserError(
            f"`{param}` {path}: cannot create files in {directory} ({exc.strerror})"
        ) from None


def _writable_file(
    param: str, path: str | None, writer: bool, made: str | None = None, appended: bool = False
) -> None:
    """Checked before training, not found out after it (``writer``: this rank writes it;
    ``made``: the ``--checkpoint-dir`` this run creates, which may hold it).

    ``--save`` is written beside and renamed over, so what is there must be a regular file:
    a rename would put the file in the place of a device or a pipe. ``--metrics`` is
    ``appended``: emptied, then opened for each line, so it must take writes, and must not be
    a pipe or a socket, whose reader would leave at the first line's end (the next line
    would then wait for another reader forever); a terminal or ``/dev/full`` is written."""
    if path is None:
        return
    from xpnn.checkpoint import CHECKPOINT_NAME

    with path_problems(param, path):
        parent = Path(path).resolve().parent
        in_checkpoints = made is not None and parent == Path(made).resolve()
        there = Path(path).stat().st_mode if Path(path).exists() else None
        if there is None and parent.exists() and not parent.is_dir():
            raise UserError(f"`{param}` {path}: {Path(path).parent} is not a directory")
        if there is None and not parent.is_dir() and not in_checkpoints:
            raise UserError(f"`{param}` {path}: directory {Path(path).parent} does not exist")
        if there is not None and stat.S_ISDIR(there):
            raise UserError(f"`{param}` {path}: is a directory; give a file name")
        if there is not None and not appended and not stat.S_ISREG(there):
            raise UserError(f"`{param}` {path}: exists and is not a regular file")
        if there is not None and (stat.S_ISFIFO(there) or stat.S_ISSOCK(there)):
            raise UserError(f"`{param}` {path}: is a pipe or a socket; give a file name")
        if in_checkpoints and CHECKPOINT_NAME.fullmatch(Path(path).name):
            raise UserError(
                f"`{param}` {path}: a name `checkpoint_dir` uses for the run's checkpoints"
            )
    if not writer:
        return
    if there is None or stat.S_ISREG(there):  # a device is written in place: nothing is made
        _takes_files(param, path, parent)
    if not appended and parent.is_dir():  # --save: what a killed run left of its file
        import glob

        from xpnn.checkpoint import remove_unfinished

        with path_problems(param, path):
            remove_unfinished(parent, glob.escape(Path(path).name))
    if appended and there is not None:  # a read-only file in a writable directory
        try:
            with open(path, "ab"):
                pass
        except OSError as exc:
            raise UserError(f"`{param}` {path}: cannot write to it ({exc.strerror})") from None


def _checkpoint_dir(path: str | None, writer: bool, resume: bool) -> None:
    """The directory is made now, by the rank that will write into it, so that a place where
    it cannot be made or written fails before the first epoch rather than at its end. A new
    run (no ``--resume``) refuses a directory that holds another run's checkpoints
    (``refuse_other_runs``)."""
    if path is None:
        return
    with path_problems("checkpoint_dir", path):
        if Path(path).exists() and not Path(path).is_dir():
            raise UserError(f"`checkpoint_dir` {path}: exists and is not a directory")
        if not writer:
            return
        from xpnn.checkpoint import refuse_other_runs

        if not resume:
            refuse_other_runs(path)
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"`checkpoint_dir` {path}: cannot create the directory ({exc.strerror})"
        ) from None
    _takes_files("checkpoint_dir", path, Path(path))
    from xpnn.checkpoint import remove_unfinished

    with path_problems("checkpoint_dir", path):
        remove_unfinished(path)


def check_paths(spec: RunSpec, writer: bool) -> None:
    """The files and directory the run will write, checked before it trains (``writer``: this
    rank writes them)."""
    # first, so that --save and --metrics may name files in it (run1/final.npz)
    _checkpoint_dir(spec.checkpoint_dir, writer, spec.resume)
    made = spec.checkpoint_dir
    _writable_file("metrics", spec.metrics, writer, made=made, appended=True)
    _writable_file("save", spec.save, writer, made=made)
    if spec.save and spec.metrics and Path(spec.save).resolve() == Path(spec.metrics).resolve():
        raise UserError(f"`save` {spec.save}: the same file as `metrics`")


def flags_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each parameter's flag: ``batch_size`` -> ``--batch-size``."""
    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    return flags | {"progress": "--no-progress"}


FLAGS = flags_of(build_parser())


def flag_words(text: str) -> str:
    """A library message as the command line says it: each parameter named as its flag."""
    return PARAM.sub(lambda m: FLAGS.get(m[1], m[0]), text)


def to_spec(args: argparse.Namespace) -> RunSpec:
    """The run the flags describe."""
    given = vars(args)
    spec = RunSpec(**{f.name: given[f.name] for f in fields(RunSpec) if f.name in given})
    spec.progress = not args.no_progress
    return spec


def _say(line: str, err: bool = False) -> None:
    print(flag_words(line), file=sys.stderr if err else sys.stdout, flush=True)


def train_main(args: argparse.Namespace, callbacks: Sequence[Any] = ()) -> int:
    # NumPy is loaded while the early handler only notes a Ctrl-C: its C start-up turns one that
    # lands mid-import into an ImportError, which run_guarded could not tell from a bad install
    import numpy  # noqa: F401

    from xpnn.runtime import stall
    from xpnn.runtime.failure import (
        agree_timeout,
        run_guarded,
        stop_grace,
        stop_when_stuck,
        terminate_on_sigterm,
    )
    from xpnn.runtime.world import init_world

    stall.set_limits(args.stall_warn, args.stall_abort)  # the setup's waits too
    world = init_world()
    terminate_on_sigterm()  # Slurm's time limit: stop as on Ctrl-C, checkpoints left whole
    stop_when_stuck(stop_grace())  # ... and within seconds even where a rank cannot
    agree_timeout()  # read when a rank fails, where a typo in it would hide the failure
    # Guarded from the first line of setup: Ctrl-C while the data loads is "interrupted" too.
    return run_guarded(world, lambda: _train(to_spec(args), world, callbacks))


def _train(spec: RunSpec, world: Any, callbacks: Sequence[Any]) -> int:
    from xpnn.run import build_run, notes, summary
    from xpnn.runtime.failure import agree_on_user_errors, one_line
    from xpnn.train import TrainingDiverged

    agree_on_user_errors(world, lambda: check_paths(spec, writer=world.rank == 0))
    trainer = build_run(spec, world, callbacks, log=_say)
    if world.rank == 0:
        for line in summary(trainer):
            _say(f"xpnn: {line}")
        for note in notes(spec, trainer, world):
            _say(f"xpnn: note: {note}", err=True)
    # A loss gone to inf/NaN is reported once, after its epoch (Trainer._diverged): NumPy's
    # per-operation overflow warnings would only print the same news many times over.
    warnings.filterwarnings(
        "ignore", r"(overflow|invalid value|divide by zero) encountered", RuntimeWarning, r"xpnn\."
    )
    try:
        trainer.run()
    except TrainingDiverged as exc:  # every rank leaves with 1 together
        if trainer.is_root:
            _say(f"xpnn: {exc}: stopped, with nothing saved from it; try a smaller --lr", True)
        return 1
    except MemoryError as exc:  # a step's activations: under ulimit -v, or CuPy's OutOfMemory
        raise UserError(
            f"--batch-size {trainer.cfg.batch_size}: a training step ran out of memory "
            f"({one_line(str(exc)) or type(exc).__name__}); try a smaller batch"
        ) from None
    return 0


def _info(as_json: bool) -> int:
    """``python -m xpnn info``; rank 0 alone prints, so only it can find stdout gone (``|
    true``) or full (``>/dev/full``): one line, as training says it."""
    from xpnn.info import info_main

    try:
        return info_main(as_json=as_json)
    except OSError as exc:
        from xpnn.runtime.failure import describe, say, stopped_from_outside

        message, code = stopped_from_outside(exc) or (describe(exc), 1)
        say(f"xpnn: {message}")
        return code


def main(argv: list[str] | None = None, callbacks: Sequence[Any] = ()) -> int:
    """``python -m xpnn``; ``callbacks`` (``xpnn.train.Callback``) join the trainer's."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plot":
        from xpnn.plot import main as plot_main

        return plot_main(argv[1:])
    command = argv.pop(0) if argv and argv[0] in ("train", "info") else "train"
    parser = build_info_parser() if command == "info" else build_parser()
    try:
        args = parser.parse_args(argv)
    except _ArgError as exc:
        if launch_rank() == 0:
            print(f"xpnn: {exc}", file=sys.stderr)
        return 2
    with worded(flag_words):  # every message printed from here names flags
        try:
            if command == "info":
                from xpnn.interrupts import hand_over
                from xpnn.runtime.failure import Terminated

                hand_over(Terminated)  # no run_guarded here: Ctrl-C is the except clause's below
                return _info(args.json)
            return train_main(args, callbacks)
        except UserError as exc:  # before MPI (the launcher's variables): nothing to agree on,
            if launch_rank() == 0:  # but every process found the same, so one of them says it
                print(f"xpnn: {user_message(exc)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as exc:  # Ctrl-C while NumPy or MPI start (xpnn.cli.main called
            from xpnn.runtime.failure import say, stopped_from_outside  # without xpnn.__main__)

            message, code = stopped_from_outside(exc) or ("interrupted", 130)
            if launch_rank() == 0:
                say(f"xpnn: {message}")
            return code
