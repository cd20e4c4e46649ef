"""``python -m xpnn [train|info|plot]``: flags that fill a ``RunSpec``, checks of the paths
given, and the exit codes: 0 success; 2 a user error, one line naming the flag or file, printed
once for all ranks; 1 anything else."""

from __future__ import annotations

import argparse
import glob
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
from xpnn.info import info_main
from xpnn.interrupts import hand_over
from xpnn.plot import main as plot_main
from xpnn.run import MICROBATCHES, SYNTHETIC_SIZE, RunSpec, build_run, notes, summary
from xpnn.runtime import failure, stall
from xpnn.runtime.world import init_world, launch_rank

# what scripts may use
__all__ = ["FLAGS", "ArgError", "build_parser", "flag_words", "main", "to_spec"]


class ArgError(Exception):
    """A bad flag, in one line naming it (the parser's error, without the usage)."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line naming it, with no usage dump."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ArgError(message.removeprefix("argument "))


MOST = 2**31 - 1  # counts and sizes past this are typos, and past NumPy's or C's int types


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _positive_int(most: int = MOST):  # noqa: ANN202
    def parse(text: str) -> int:
        value = _int(text)
        if not 1 <= value <= most:
            bound = "at least 1" if value < 1 else f"at most {most}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def _whole_number(most: int = MOST, shown: str = ""):  # noqa: ANN202
    def parse(text: str) -> int:
        value = _int(text)
        if not 0 <= value <= most:
            raise argparse.ArgumentTypeError(f"must be from 0 to {shown or most}, got {value}")
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


def _rate(text: str) -> float:
    """A decay rate in [0, 1): momentum, Adam's betas."""
    value = _float_from(0.0)(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be below 1, got {text}")
    return value


def _betas(text: str) -> tuple[float, float]:
    parts = text.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected two rates like 0.9,0.999, got {text!r}")
    first, second = (_rate(part) for part in parts)
    return first, second


_seed = _whole_number(2**64 - 1, "2**64 - 1")  # a checkpoint keeps the seed as a uint64


def build_info_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m xpnn info", description="What this machine offers to xpnn.")
    p.add_argument("--json", action="store_true", help="machine-readable")
    return p


def build_parser() -> argparse.ArgumentParser:
    """A flag per ``RunSpec`` field (``--no-progress`` for ``progress``), with its defaults."""
    p = _Parser(
        prog="python -m xpnn",
        usage="python -m xpnn [train] [flags]  |  info [--json]  |  plot METRICS.jsonl... [-o PNG]",
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
        help="linear: multiply --lr by the number of replicas, the ranks that split a batch "
        "(Goyal et al.; default none)",
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
    a(
        "--warmup-steps",
        type=_whole_number(),
        help="the warmup counted in steps, instead of --warmup-epochs (default 0)",
    )
    a(
        "--min-lr",
        type=_float_from(0.0),
        help="--schedule cosine: the rate the cosine ends at (default 0; at most --lr)",
    )
    a(
        "--optimizer",
        choices=["sgd", "momentum", "adam", "adamw"],
        help="adamw: Adam with decoupled weight decay on the weight matrices (default adam)",
    )
    a("--momentum", type=_rate, help="--optimizer momentum: its coefficient (default 0.9)")
    a("--betas", type=_betas, help="--optimizer adam/adamw: B1,B2 (default 0.9,0.999)")
    a(
        "--eps",
        type=_float_from(0.0, inclusive=False),
        help="--optimizer adam/adamw: added to the denominator (default 1e-8)",
    )
    a(
        "--weight-decay",
        type=_float_from(0.0),
        help="--optimizer adamw: parameters with 2+ dimensions shrink by lr x this a step "
        "(default 0.01; biases and norm gains never)",
    )
    a(
        "--clip-norm",
        type=_float_from(0.0, inclusive=False),
        metavar="C",
        help="scale each step's gradients down to global norm C, over the whole model on "
        "any number of ranks (default: no clipping)",
    )
    a(
        "--accumulate",
        type=count,
        metavar="K",
        help="take each global batch in K micro-steps, summing their gradients: the same "
        "step in less memory (default 1)",
    )
    a("--steps", type=count, help="train this many steps instead of --epochs")
    a(
        "--eval-every",
        type=count,
        metavar="M",
        help="--steps: evaluate and write a record every M steps (default: at the end)",
    )
    a("--dtype", choices=["float32", "float64"], help="(default float32)")
    a(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        help="bf16, fp16: forward and backward in low precision on fp32 master parameters "
        "(fp16 with dynamic loss scaling; default fp32)",
    )
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
        help="allreduce bucket size in MiB (default 25; mpi-host and the GPU comms)",
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
    """A throwaway file proves ``directory`` can be written, before the training, not after."""
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
    """``writer``: this rank writes it; ``made``: the checkpoint dir this run creates. A rename
    replaces ``--save``; ``--metrics`` is ``appended`` to, so no pipe, whose reader would leave."""
    if path is None:
        return
    from xpnn.checkpoint import CHECKPOINT_NAME, remove_unfinished

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
        with path_problems(param, path):
            remove_unfinished(parent, glob.escape(Path(path).name))
    if appended and there is not None:  # a read-only file in a writable directory
        try:
            with open(path, "ab"):
                pass
        except OSError as exc:
            raise UserError(f"`{param}` {path}: cannot write to it ({exc.strerror})") from None


def _checkpoint_dir(path: str | None, writer: bool, resume: bool) -> None:
    """Made now by the rank that writes into it, so that a bad place fails before training."""
    if path is None:
        return
    from xpnn.checkpoint import refuse_other_runs, remove_unfinished

    with path_problems("checkpoint_dir", path):
        if Path(path).exists() and not Path(path).is_dir():
            raise UserError(f"`checkpoint_dir` {path}: exists and is not a directory")
        if not writer:
            return
        if not resume:
            refuse_other_runs(path)
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"`checkpoint_dir` {path}: cannot create the directory ({exc.strerror})"
        ) from None
    _takes_files("checkpoint_dir", path, Path(path))
    with path_problems("checkpoint_dir", path):
        remove_unfinished(path)


def check_paths(spec: RunSpec, writer: bool) -> None:
    """What the run will write, the directory first: ``--save`` may name a file in it."""
    _checkpoint_dir(spec.checkpoint_dir, writer, spec.resume)
    made = spec.checkpoint_dir
    _writable_file("metrics", spec.metrics, writer, made=made, appended=True)
    _writable_file("save", spec.save, writer, made=made)
    if spec.save and spec.metrics and Path(spec.save).resolve() == Path(spec.metrics).resolve():
        raise UserError(f"`save` {spec.save}: the same file as `metrics`")


# Each parameter's flag: ``batch_size`` -> ``--batch-size``.
FLAGS = {a.dest: a.option_strings[0] for a in build_parser()._actions if a.option_strings}
FLAGS["progress"] = "--no-progress"


def flag_words(text: str) -> str:
    """A library message as the command line says it: each parameter named as its flag."""
    return PARAM.sub(lambda m: FLAGS.get(m[1], m[0]), text)


def to_spec(args: argparse.Namespace) -> RunSpec:
    given = vars(args)
    spec = RunSpec(**{f.name: given[f.name] for f in fields(RunSpec) if f.name in given})
    spec.progress = not args.no_progress
    return spec


def _say(line: str, err: bool = False) -> None:
    print(flag_words(line), file=sys.stderr if err else sys.stdout, flush=True)


def train_main(args: argparse.Namespace, callbacks: Sequence[Any] = ()) -> int:
    # Loaded while the early handler only notes a Ctrl-C: one mid-import is an ImportError
    import numpy  # noqa: F401

    stall.set_limits(args.stall_warn, args.stall_abort)  # the setup's waits too
    world = init_world()
    failure.terminate_on_sigterm()  # Slurm's time limit: stop as on Ctrl-C, checkpoints whole
    failure.stop_when_stuck(failure.stop_grace())  # ... and within seconds where a rank cannot
    failure.agree_timeout()  # read when a rank fails, where a typo in it would hide the failure
    return failure.run_guarded(world, lambda: _train(to_spec(args), world, callbacks))


def _train(spec: RunSpec, world: Any, callbacks: Sequence[Any]) -> int:
    from xpnn.train import TrainingDiverged

    failure.agree_on_user_errors(world, lambda: check_paths(spec, writer=world.rank == 0))
    trainer = build_run(spec, world, callbacks, log=_say)
    if world.rank == 0:
        for line in summary(trainer):
            _say(f"xpnn: {line}")
        for note in notes(spec, trainer, world):
            _say(f"xpnn: note: {note}", err=True)
    # A loss gone to inf/NaN is reported once, after its epoch: not per NumPy operation.
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
            f"({failure.one_line(str(exc)) or type(exc).__name__}); try a smaller batch"
        ) from None
    return 0


def _info(as_json: bool) -> int:
    """``python -m xpnn info``; stdout gone or full is one line, as training says it."""
    try:
        return info_main(as_json=as_json)
    except OSError as exc:
        message, code = failure.stopped_from_outside(exc) or (failure.describe(exc), 1)
        failure.say(f"xpnn: {message}")
        return code


def main(argv: list[str] | None = None, callbacks: Sequence[Any] = ()) -> int:
    """``python -m xpnn``; ``callbacks`` (``xpnn.train.Callback``) join the trainer's."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plot":
        return plot_main(argv[1:])
    command = argv.pop(0) if argv and argv[0] in ("train", "info") else "train"
    parser = build_info_parser() if command == "info" else build_parser()
    try:
        args = parser.parse_args(argv)
    except ArgError as exc:
        if launch_rank() == 0:
            print(f"xpnn: {exc}", file=sys.stderr)
        return 2
    with worded(flag_words):  # every message printed from here names flags
        try:
            if command == "info":
                hand_over(failure.Terminated)  # no run_guarded: Ctrl-C is for the except below
                return _info(args.json)
            return train_main(args, callbacks)
        except UserError as exc:  # before MPI: every process found the same, one says it
            if launch_rank() == 0:
                print(f"xpnn: {user_message(exc)}", file=sys.stderr)
            return 2
        except KeyboardInterrupt as exc:  # while NumPy or MPI start, without xpnn.__main__
            message, code = failure.stopped_from_outside(exc) or ("interrupted", 130)
            if launch_rank() == 0:
                failure.say(f"xpnn: {message}")
            return code
