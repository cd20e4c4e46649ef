"""Command line: ``python -m xpnn [train] [flags]`` and ``python -m xpnn info``.

Exit codes (the contract): 0 success; 2 a user error, printed as one line naming the flag or file;
1 anything else. Under ``mpiexec`` every rank parses the same flags, so a flag error is printed
by rank 0 only; errors found while setting up are agreed on by all ranks and printed once; a
failure during training aborts the whole MPI job.
"""

from __future__ import annotations

import argparse
import math
import os
import stat
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

from xpnn.errors import UserError, path_problems


class _ArgError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (no usage dump) so it fits the contract."""

    def error(self, message: str) -> None:  # type: ignore[override]
        # our type checks name their flag; argparse would name it a second time before that
        flag = message.split(": ", 1)[0].removeprefix("argument ")
        rest = message.removeprefix(f"argument {flag}: ")
        raise _ArgError(rest if rest.startswith(f"{flag}: ") else message)


MOST = 2**31 - 1  # counts and sizes past this are typos, and past NumPy's or C's int types


def _positive_int(flag: str, most: int = MOST):  # noqa: ANN202
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: not an integer: {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{flag}: must be at least 1, got {value}")
        if value > most:
            raise argparse.ArgumentTypeError(f"{flag}: must be at most {most}, got {value}")
        return value

    return parse


def _hidden(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(t) for t in text.split(","))  # "16,,8" is a typo, not "16,8"
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--hidden: expected sizes like 512,256, got {text!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--hidden: sizes must be positive, got {text!r}")
    if max(sizes) > MOST:
        raise argparse.ArgumentTypeError(f"--hidden: sizes must be at most {MOST}, got {text!r}")
    return sizes


def _path(flag: str):  # noqa: ANN202
    """A file or directory name; an empty one is a slip (the shell's ``--save $UNSET``)."""

    def parse(text: str) -> str:
        if not text.strip():
            raise argparse.ArgumentTypeError(f"{flag}: empty path")
        return text

    return parse


def _float_from(flag: str, low: float, inclusive: bool = True, most: float = math.inf):  # noqa: ANN202
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag}: not a number: {text!r}") from None
        if not (value >= low if inclusive else value > low):  # also refuses nan
            bound = f">= {low:g}" if inclusive else f"> {low:g}"
            raise argparse.ArgumentTypeError(f"{flag}: must be {bound}, got {text}")
        if math.isinf(value):
            raise argparse.ArgumentTypeError(f"{flag}: must be finite, got {text}")
        if value > most:
            raise argparse.ArgumentTypeError(f"{flag}: must be at most {most:.10g}, got {text}")
        return value

    return parse


SEED_END = 2**64  # a checkpoint keeps the seed as a 64-bit integer (NumPy's uint64)


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seed: not an integer: {text!r}") from None
    if not 0 <= value < SEED_END:
        raise argparse.ArgumentTypeError(f"--seed: must be from 0 to 2**64 - 1, got {value}")
    return value


MICROBATCHES = 4  # GPipe's default for --parallel pipeline
SYNTHETIC_SIZE = 6000  # --dataset synthetic's samples when --synthetic-size is not given
BATCH = 128  # the global batch when neither --batch-size nor --per-rank-batch is given
HIDDEN = (512, 256)  # the MLP's default hidden layers


def build_info_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m xpnn info", description="What this machine offers to xpnn.")
    p.add_argument("--json", action="store_true", help="machine-readable")
    return p


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m xpnn",
        usage="python -m xpnn [train] [flags]  |  python -m xpnn info [--json]",
        description="Train a network over xp, alone or under MPI (mpiexec -n N python -m xpnn "
        "...). `python -m xpnn info` says what this machine offers: backends, devices, cores, "
        "the MPI library and whether it is CUDA-aware.",
    )
    a = p.add_argument
    a(
        "--backend",
        default="numpy",
        choices=["numpy", "numba", "cupy", "auto"],
        help="array library (default numpy); numba adds compiled CPU kernels; auto: cupy where "
        "a GPU is usable, else numba",
    )
    a("--model", default="mlp", choices=["mlp", "cnn"], help="(default mlp)")
    a("--hidden", type=_hidden, default=None, help="MLP hidden sizes (default 512,256)")
    a("--activation", default=None, choices=["relu", "sigmoid", "tanh"], help="MLP (relu)")
    a(
        "--loss",
        default="softmax_cross_entropy",
        choices=["softmax_cross_entropy", "sigmoid_bce"],
        help="softmax_cross_entropy (default) or sigmoid_bce (one-vs-rest logistic losses)",
    )
    a(
        "--dataset",
        default="fashion-mnist",
        choices=["mnist", "fashion-mnist", "synthetic"],
        help="(default fashion-mnist)",
    )
    a("--data-dir", type=_path("--data-dir"), help="directory holding the four IDX files")
    a(
        "--replicate",
        type=_positive_int("--replicate"),
        default=1,
        help="repeat the training set K times (scaling studies; default 1)",
    )
    a(
        "--synthetic-size",
        type=_positive_int("--synthetic-size"),
        default=None,
        help=f"--dataset synthetic: training samples (default {SYNTHETIC_SIZE:,})",
    )
    a("--epochs", type=_positive_int("--epochs"), default=5, help="(default 5)")
    a("--batch-size", default=None, help="GLOBAL batch size (128), or 'full' for full-batch GD")
    a(
        "--per-rank-batch",
        type=_positive_int("--per-rank-batch"),
        default=None,
        help="batch per rank; the global batch is this times the number of ranks",
    )
    a("--lr", type=_float_from("--lr", 0.0, inclusive=False), default=1e-3, help="(default 0.001)")
    a(
        "--lr-scaling",
        default="none",
        choices=["none", "linear"],
        help="linear: multiply --lr by the number of ranks (Goyal et al.; default none)",
    )
    a(
        "--warmup-epochs",
        # past this the warmup's steps (epochs x steps an epoch) overflow a 64-bit count
        type=_float_from("--warmup-epochs", 0.0, most=MOST),
        default=0.0,
        help="raise the rate linearly from ~0 to --lr over E epochs (default 0)",
    )
    a(
        "--schedule",
        default="constant",
        choices=["constant", "step", "cosine"],
        help="step: x0.1 every --step-epochs epochs; cosine: half a cosine towards 0 "
        "(default constant)",
    )
    a(
        "--step-epochs",
        type=_positive_int("--step-epochs"),
        default=None,
        help="--schedule step: epochs between decays (default: a third of --epochs)",
    )
    a("--optimizer", default="adam", choices=["sgd", "momentum", "adam"], help="(default adam)")
    a("--dtype", default="float32", choices=["float32", "float64"], help="(default float32)")
    a(
        "--seed",
        type=_seed,
        default=0,
        help="initial weights, shuffles and dropout masks (default 0)",
    )
    a(
        "--threads",
        type=_positive_int("--threads", most=4096),
        default=None,
        help="BLAS/Numba threads per rank (default: the cores it may run on, shared with the "
        "node's ranks that may run on them too)",
        # past a few thousand, BLAS libraries overflow or crawl
    )
    a("--metrics", type=_path("--metrics"), help="JSON-lines metrics file (rank 0 writes it)")
    a("--save", type=_path("--save"), help="save parameters to FILE.npz at the end")
    a("--checkpoint-dir", type=_path("--checkpoint-dir"))
    a("--resume", action="store_true", help="continue from the latest checkpoint")
    a(
        "--comm",
        default="auto",
        choices=["auto", "mpi-shm", "mpi-host", "mpi-cuda", "nccl"],
        help="how ranks exchange gradients (default auto: the fastest that works here)",
    )
    a(
        "--bucket-mb",
        # below ~1 kB a bucket is an allreduce per few values: a step takes seconds
        type=_float_from("--bucket-mb", 0.001, most=2**20),  # a TB bucket is a typo
        default=None,
        help="allreduce bucket size in MB (default 25; mpi-host and the GPU comms)",
    )
    a(
        "--node-share",
        default=None,
        choices=["auto", "gradients", "activations"],
        help="mpi-shm: what the ranks of a node share, their gradients (summed by the update) "
        "or the batch's activations (each rank computes some rows of every gradient; MLPs "
        "only); auto (default): activations when they are fewer values than the parameters",
    )
    a(
        "--parallel",
        default="data",
        choices=["data", "tensor", "pipeline"],
        help="data: each rank a share of every batch; tensor: each rank a slice of every "
        "pair of Dense layers (MLP only); pipeline: each rank a run of consecutive layers "
        "(default data)",
    )
    a(
        "--model-ranks",
        type=_positive_int("--model-ranks"),
        default=None,
        help="--parallel tensor/pipeline: ranks that hold one replica of the network (default: "
        "all); N ranks train N / K replicas data-parallel (2-D parallelism)",
    )
    a(
        "--microbatches",
        type=_positive_int("--microbatches"),
        default=None,
        help=f"--parallel pipeline: micro-batches per global batch (default {MICROBATCHES})",
    )
    a(
        "--pipeline-schedule",
        choices=["gpipe", "1f1b"],
        default=None,
        help="--parallel pipeline: gpipe (all forwards, then all backwards; the default) or "
        "1f1b (a forward and a backward in turn: activations of at most stages - s "
        "micro-batches held, not M)",
    )
    a(
        "--recompute",
        action="store_true",
        default=None,
        help="--parallel pipeline: keep each micro-batch's stage input, not its activations, "
        "and run its forward again before its backward (less memory, one more forward)",
    )
    a("--no-progress", action="store_true", help="no progress bar even on a terminal")
    return p


def launch_rank() -> int:
    """This process's rank as the launcher says, without starting MPI (0 outside a launcher):
    who prints a flag error that every process found (the command line, the benchmarks)."""
    for var in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def _takes_files(flag: str, path: str, directory: Path) -> None:
    """A throwaway file proves ``directory`` can be written: permissions, read-only mounts and
    pseudo file systems (/proc, /sys) all show up here instead of after the training."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        raise UserError(
            f"{flag} {path}: cannot create files in {directory} ({exc.strerror})"
        ) from None


def _writable_file(
    flag: str, path: str | None, writer: bool, made: str | None = None, appended: bool = False
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

    with path_problems(flag, path):
        parent = Path(path).resolve().parent
        in_checkpoints = made is not None and parent == Path(made).resolve()
        there = Path(path).stat().st_mode if Path(path).exists() else None
        if there is None and parent.exists() and not parent.is_dir():
            raise UserError(f"{flag} {path}: {Path(path).parent} is not a directory")
        if there is None and not parent.is_dir() and not in_checkpoints:
            raise UserError(f"{flag} {path}: directory {Path(path).parent} does not exist")
        if there is not None and stat.S_ISDIR(there):
            raise UserError(f"{flag} {path}: is a directory; give a file name")
        if there is not None and not appended and not stat.S_ISREG(there):
            raise UserError(f"{flag} {path}: exists and is not a regular file")
        if there is not None and (stat.S_ISFIFO(there) or stat.S_ISSOCK(there)):
            raise UserError(f"{flag} {path}: is a pipe or a socket; give a file name")
        if in_checkpoints and CHECKPOINT_NAME.fullmatch(Path(path).name):
            raise UserError(
                f"{flag} {path}: a name --checkpoint-dir uses for the run's checkpoints"
            )
    if not writer:
        return
    if there is None or stat.S_ISREG(there):  # a device is written in place: nothing is made
        _takes_files(flag, path, parent)
    if not appended and parent.is_dir():  # --save: what a killed run left of its file
        import glob

        from xpnn.checkpoint import remove_unfinished

        with path_problems(flag, path):
            remove_unfinished(parent, glob.escape(Path(path).name))
    if appended and there is not None:  # a read-only file in a writable directory
        try:
            with open(path, "ab"):
                pass
        except OSError as exc:
            raise UserError(f"{flag} {path}: cannot write to it ({exc.strerror})") from None


def _checkpoint_dir(path: str | None, writer: bool, resume: bool) -> None:
    """The directory is made now, by the rank that will write into it, so that a place where
    it cannot be made or written fails before the first epoch rather than at its end. A new
    run (no ``--resume``) refuses a directory that holds another run's checkpoints
    (``refuse_other_runs``)."""
    if path is None:
        return
    with path_problems("--checkpoint-dir", path):
        if Path(path).exists() and not Path(path).is_dir():
            raise UserError(f"--checkpoint-dir {path}: exists and is not a directory")
        if not writer:
            return
        from xpnn.checkpoint import refuse_other_runs

        if not resume:
            refuse_other_runs(path)
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"--checkpoint-dir {path}: cannot create the directory ({exc.strerror})"
        ) from None
    _takes_files("--checkpoint-dir", path, Path(path))
    from xpnn.checkpoint import remove_unfinished

    with path_problems("--checkpoint-dir", path):
        remove_unfinished(path)


def _global_batch(args: argparse.Namespace, size: int, n_train: int) -> int:
    if args.per_rank_batch is not None:
        if args.batch_size is not None:
            raise UserError(
                "--batch-size and --per-rank-batch: give one (the global batch, or the batch "
                "of each replica)"
            )
        return args.per_rank_batch * size
    if args.batch_size is None:
        return BATCH
    if args.batch_size == "full":
        return n_train
    try:
        value = int(args.batch_size)
    except ValueError:
        raise UserError(
            f"--batch-size: expected a number or 'full', got {args.batch_size!r}"
        ) from None
    if value < 1:
        raise UserError(f"--batch-size: must be at least 1, got {value}")
    return value


def _setup(args: argparse.Namespace, world: Any) -> tuple:
    """Everything rank-local that can fail because of the user's input (no communication, so
    the ranks can agree on the outcome afterwards)."""
    from xpnn.backends import get_backend
    from xpnn.data import load_dataset
    from xpnn.nn import build_model
    from xpnn.parallel.data_parallel import DEFAULT_BUCKET_MB
    from xpnn.parallel.layout import place_of
    from xpnn.parallel.threads import apply_threads, threads_per_rank
    from xpnn.train import TrainConfig

    writer = world.rank == 0  # rank 0 alone saves, logs and checkpoints
    if args.resume and not args.checkpoint_dir:
        raise UserError("--resume: needs --checkpoint-dir")
    if args.node_share == "activations" and args.parallel != "data":
        raise UserError(
            f"--node-share activations: only with --parallel data (this run has --parallel "
            f"{args.parallel}, whose ranks split the network)"
        )
    # first, so that --save and --metrics may name files in it (run1/final.npz)
    _checkpoint_dir(args.checkpoint_dir, writer, args.resume)
    _writable_file("--metrics", args.metrics, writer, made=args.checkpoint_dir, appended=True)
    _writable_file("--save", args.save, writer, made=args.checkpoint_dir)
    if args.save and args.metrics and Path(args.save).resolve() == Path(args.metrics).resolve():
        raise UserError(f"--save {args.save}: the same file as --metrics")
    threads = threads_per_rank(world.local_size, override=args.threads, share=world.cores)
    thread_info = apply_threads(threads)
    backend = get_backend(args.backend, args.dtype, device_id=world.local_rank)
    try:
        data = load_dataset(
            args.dataset,
            args.data_dir,
            replicate=args.replicate,
            synthetic_size=args.synthetic_size or SYNTHETIC_SIZE,
            seed=args.seed,
        )
    except MemoryError as exc:  # --replicate 100000000: NumPy says how much it wanted
        size = args.synthetic_size or SYNTHETIC_SIZE
        what = [f"--synthetic-size {size}"] if args.dataset == "synthetic" else []
        what += [f"--replicate {args.replicate}"] if args.replicate > 1 else []
        what = " with ".join(what) or f"--dataset {args.dataset}"
        raise UserError(f"{what}: the data set does not fit in memory ({exc})") from None
    if args.model == "cnn" and tuple(data.input_shape) != (1, 28, 28):
        raise UserError(f"--model cnn: needs 1x28x28 images, {args.dataset} has {data.input_shape}")
    hidden, activation = args.hidden or HIDDEN, args.activation or "relu"
    model = build_model(args.model, hidden, activation, data.num_classes, args.loss)
    place = place_of(world.rank, world.size, args.parallel, args.model_ranks)
    if args.parallel == "tensor":
        from xpnn.parallel.tensor_parallel import split_layers

        model.layers = split_layers(model.layers, place.index, place.model_ranks)
    try:
        if args.parallel == "pipeline":
            from xpnn.parallel.pipeline_parallel import DEFAULT_SCHEDULE, build_stage

            model = build_stage(
                model,
                data.input_shape,
                backend,
                args.seed,
                place.index,
                place.model_ranks,
                microbatches=args.microbatches or MICROBATCHES,
                schedule=args.pipeline_schedule or DEFAULT_SCHEDULE,
                recompute=bool(args.recompute),
            )
        else:
            model.build(data.input_shape, backend, args.seed)
    except MemoryError as exc:  # --hidden 99999999999: NumPy says how much it wanted
        what = f"--hidden {','.join(map(str, hidden))}" if args.model == "mlp" else "--model cnn"
        raise UserError(f"{what}: the network does not fit in memory ({exc})") from None
    # the ranks that each take a share of the batch: one per replica of the network
    replicas = place.replicas
    batch = _global_batch(args, replicas, data.n_train)
    lr = args.lr * (replicas if args.lr_scaling == "linear" else 1)
    cfg = TrainConfig(
        epochs=args.epochs,
        batch_size=batch,
        lr=lr,
        optimizer=args.optimizer,
        schedule=args.schedule,
        warmup_epochs=args.warmup_epochs,
        step_epochs=args.step_epochs,
        seed=args.seed,
        bucket_mb=DEFAULT_BUCKET_MB if args.bucket_mb is None else args.bucket_mb,
        node_share=args.node_share or "auto",
        metrics=args.metrics,
        save=args.save,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
        network={"loss": args.loss, **({"activation": activation} if args.model == "mlp" else {})},
        progress=not args.no_progress,
        parallel=args.parallel,
        extra={
            "threads": thread_info["threads"],
            "model": args.model,
            "dataset": args.dataset,
            "global_batch": batch,
            "dtype": args.dtype,
            "parallel": args.parallel,
            "model_ranks": place.model_ranks,
            "replicas": replicas,
            **(
                {
                    "microbatches": model.microbatches,
                    "pipeline_schedule": model.schedule,
                    "recompute": model.recompute,
                }
                if args.parallel == "pipeline"
                else {}
            ),
        },
    )
    return backend, data, model, cfg, place


def _announce(
    backend: Any, groups: Any, model: Any, cfg: Any, data: Any, args: Any, world: Any
) -> None:
    comm = groups.world
    if comm.rank != 0:
        return
    note = f" ({groups.fallback_reason})" if groups.fallback_reason else ""
    from xpnn.parallel.threads import describe_threads
    from xpnn.parallel.whole import is_spread, whole_size

    summary = model.summary()
    if is_spread(model):  # tensor and pipeline parallel: rank 0 holds a part
        summary += f" on rank 0 of {whole_size(model):,}, {cfg.parallel} parallel"
        if groups.data.size > 1:
            summary += f" over {groups.model.size} ranks x {groups.data.size} replicas"
    print(
        f"xpnn: {summary}\n"
        f"xpnn: {data.name} {data.n_train} train / {data.x_test.shape[0]} test, "
        f"global batch {cfg.batch_size}, {cfg.optimizer} lr {cfg.lr:g}, backend "
        f"{backend.describe()}, comm {groups.name}{note}, {comm.size} rank(s) x "
        f"{describe_threads(cfg.extra)}",
        flush=True,
    )
    if groups.auto_fallback:
        print(
            f"xpnn: note: comm {groups.name}: {groups.auto_fallback}", file=sys.stderr, flush=True
        )
    for flag, why in ineffective_flags(args, groups):
        print(f"xpnn: note: {flag} has no effect {why}", file=sys.stderr, flush=True)
    for note in _questionable_settings(args, cfg, world, data.n_train):
        print(f"xpnn: note: {note}", file=sys.stderr, flush=True)


def _questionable_settings(
    args: Any, cfg: Any, world: Any, n_train: int | None = None
) -> list[str]:
    """Settings that work but are probably not what was meant: said once, not refused."""
    from xpnn.parallel.threads import node_cores

    notes = []
    if args.parallel == "pipeline":
        # a batch is cut into at most one micro-batch per sample: more are never run
        batch = min(cfg.batch_size, n_train or cfg.batch_size)
        replicas = cfg.extra.get("replicas", 1)
        share = -(-batch // replicas)  # the largest share of a batch a replica gets
        if args.microbatches is not None and args.microbatches > share:
            whose = "each replica's share of a batch" if replicas > 1 else "a batch"
            notes.append(
                f"--microbatches {args.microbatches} is more than the {share} sample(s) of "
                f"{whose}: a step runs at most {share} micro-batch(es), of one sample each"
            )
        if args.recompute and min(args.microbatches or MICROBATCHES, share) == 1:
            notes.append(
                "--recompute has no effect with one micro-batch a step: its activations are "
                "still held when its backward pass comes, so none are computed again"
            )
    if args.warmup_epochs > args.epochs:
        notes.append(
            f"--warmup-epochs {args.warmup_epochs:g} is longer than the run (--epochs "
            f"{args.epochs}): the rate never reaches --lr"
        )
    threads, share = cfg.extra["threads"], world.cores or node_cores()
    if world.crowded:
        notes.append(
            f"{world.local_size} ranks on this node share fewer cores than there are ranks "
            "(or a CPU quota worth fewer): they take turns, which is slower"
        )
    elif threads > share:
        notes.append(
            f"--threads {threads} but this rank has {share} core(s) of its own: the threads "
            "take turns, which is slower"
        )
    from xpnn.parallel.threads import REPLACED_ENV

    if REPLACED_ENV and args.threads is None:  # exported for all programs, or for this one?
        given = ", ".join(f"{var}={value}" for var, value in REPLACED_ENV.items())
        notes.append(
            f"{given} in the environment: xpnn uses {threads} thread(s) per rank (its "
            "cores); give --threads to choose"
        )
    return notes


def ineffective_flags(args: Any, groups: Any) -> list[tuple[str, str]]:
    """Flags the user gave that this run ignores, and why: said, not silently dropped."""
    from xpnn.parallel.data_parallel import uses_byte_buckets

    optional = ("hidden", "activation", "microbatches", "pipeline_schedule", "recompute")
    optional += ("step_epochs", "bucket_mb", "model_ranks", "node_share", "data_dir")
    optional += ("synthetic_size",)
    given = {flag for flag in optional if getattr(args, flag) is not None}
    found = []
    if "data_dir" in given and args.dataset == "synthetic":
        found.append(("--data-dir", "with --dataset synthetic: its samples are generated"))
    if "synthetic_size" in given and args.dataset != "synthetic":
        found.append(("--synthetic-size", f"with --dataset {args.dataset}"))
    if args.comm not in ("auto", "self") and groups.world.size == 1:
        found.append((f"--comm {args.comm}", "on 1 rank: there is nothing to exchange"))
    for flag in ("hidden", "activation"):
        if flag in given and args.model != "mlp":
            found.append((f"--{flag}", f"with --model {args.model}"))
    for flag in ("microbatches", "pipeline_schedule", "recompute"):
        if flag in given and args.parallel != "pipeline":
            found.append((f"--{flag.replace('_', '-')}", "without --parallel pipeline"))
    if "step_epochs" in given and args.schedule != "step":
        found.append(("--step-epochs", f"with --schedule {args.schedule}"))
    if "model_ranks" in given and args.parallel == "data":
        found.append(("--model-ranks", "with --parallel data: every rank holds the network"))
    data = groups.data
    if "bucket_mb" in given and data.size == 1 and args.parallel != "data":
        found.append(
            ("--bucket-mb", f"with --parallel {args.parallel}: no gradients are exchanged")
        )
    elif "bucket_mb" in given and not uses_byte_buckets(data):
        where = f"with comm {data.name} on {data.size} rank(s)"
        found.append(("--bucket-mb", f"{where}: the update's buckets are cut at layers"))
    if "node_share" in given and (data.size == 1 or uses_byte_buckets(data)):
        where = f"with comm {data.name} on {data.size} rank(s)"
        found.append(("--node-share", f"{where}: only mpi-shm shares a node's memory"))
    return found


def train_main(args: argparse.Namespace) -> int:
    from xpnn.parallel.failure import (
        agree_timeout,
        run_guarded,
        stop_grace,
        stop_when_stuck,
        terminate_on_sigterm,
    )
    from xpnn.parallel.world import init_world

    world = init_world()
    terminate_on_sigterm()  # Slurm's time limit: stop as on Ctrl-C, checkpoints left whole
    stop_when_stuck(stop_grace())  # ... and within seconds even where a rank cannot
    agree_timeout()  # read when a rank fails, where a typo in it would hide the failure
    # Guarded from the first line of setup: Ctrl-C while the data loads is "interrupted" too.
    return run_guarded(world, lambda: _train(args, world))


# Flags that may differ between ranks: where each reads its data (a node's own copy) and what
# it shows; the files only rank 0 writes; and its threads (nodes may differ in cores).
PER_RANK_FLAGS = ("data_dir", "metrics", "save", "checkpoint_dir", "no_progress", "threads")


def _same_flags(args: argparse.Namespace, world: Any) -> None:
    """Ranks started with other flags (an MPMD line, ``mpiexec -n 1 ... : -n 1 ...``) would
    train different runs and, with another --epochs or batch, wait for each other forever."""
    if world.size == 1:
        return
    mine = {k: v for k, v in sorted(vars(args).items()) if k not in PER_RANK_FLAGS}
    everyone = world.mpi_comm.allgather(mine)
    for rank, theirs in enumerate(everyone):
        for key in mine:
            if theirs[key] != everyone[0][key]:
                flag = "--" + key.replace("_", "-")
                raise UserError(
                    f"{flag}: rank {rank} was given {theirs[key]}, rank 0 {everyone[0][key]}; "
                    "every rank must get the same flags"
                )


def _threads_of_every_rank(cfg: Any, world: Any) -> None:
    """Ranks on nodes with other core counts, or given other ``--threads``, use other thread
    counts: the metrics then carry every rank's (``threads`` stays rank 0's)."""
    if world.size == 1:
        return
    counts = world.mpi_comm.allgather(cfg.extra["threads"])
    if len(set(counts)) > 1:
        cfg.extra["threads_per_rank"] = counts


def build_trainer(args: argparse.Namespace, world: Any, announce: bool = True) -> Any:
    """Everything ``python -m xpnn`` does before it trains (``bench/within_job.py`` builds two);
    each phase's user errors are agreed on by every rank."""
    from xpnn.parallel.failure import agree_on_user_errors
    from xpnn.parallel.layout import make_groups
    from xpnn.train import Trainer

    agree_on_user_errors(world, lambda: _same_flags(args, world))  # every rank calls it first
    backend, data, model, cfg, place = agree_on_user_errors(world, lambda: _setup(args, world))
    if world.size > 1:  # --data-dir may differ between ranks, the data they read may not
        from xpnn.data.datasets import check_same_data

        allgather = world.mpi_comm.allgather
        agree_on_user_errors(world, lambda: check_same_data(data, args.data_dir, allgather))
    _threads_of_every_rank(cfg, world)
    # A separate phase: on GPU backends building the communicators talks to the other ranks.
    groups = agree_on_user_errors(
        world, lambda: make_groups(world, place, backend, args.comm, args.parallel)
    )
    model.attach(groups.model)  # split layers and pipeline stages talk within their replica
    if announce:
        _announce(backend, groups, model, cfg, data, args, world)
    # A third: the trainer allocates node-shared buffers (mpi-shm), which can find /dev/shm full
    # on every rank of a node; that is a user error to print once, not a crash per rank.
    return agree_on_user_errors(
        world, lambda: Trainer(model, data, backend, groups.world, cfg, groups=groups)
    )


def _train(args: argparse.Namespace, world: Any) -> int:
    trainer = build_trainer(args, world)
    # A loss gone to inf/NaN is reported once, after its epoch (Trainer._diverged): NumPy's
    # per-operation overflow warnings would only print the same news many times over.
    warnings.filterwarnings(
        "ignore", r"(overflow|invalid value|divide by zero) encountered", RuntimeWarning, r"xpnn\."
    )
    from xpnn.parallel.failure import one_line
    from xpnn.train import TrainingDiverged

    try:
        trainer.run()
    except TrainingDiverged as exc:  # every rank leaves with 1 together
        if trainer.is_root:
            print(
                f"xpnn: {exc}: stopped, with nothing saved from it; try a smaller --lr",
                file=sys.stderr,
                flush=True,
            )
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
        from xpnn.parallel.failure import describe, say, stopped_from_outside

        message, code = stopped_from_outside(exc) or (describe(exc), 1)
        say(f"xpnn: {message}")
        return code


def main(argv: list[str] | None = None) -> int:
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
    try:
        if command == "info":
            return _info(args.json)
        return train_main(args)
    except UserError as exc:  # before MPI (the launcher's variables): nothing to agree on,
        if launch_rank() == 0:  # but every process found the same, so one of them says it
            print(f"xpnn: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C while Python, NumPy or MPI start
        from xpnn.parallel.failure import stopped_from_outside

        message, code = stopped_from_outside(exc) or ("interrupted", 130)
        print(f"xpnn: {message}", file=sys.stderr, flush=True)
        return code
