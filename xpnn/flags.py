"""The training flags: an argparse parser with a flag per ``RunSpec`` field, its choices read
from the registries that own them (backends, data sets, losses, schedules, communicators,
parallel layouts), ``to_spec`` from parsed flags, and ``flag_words`` that says a library
message's parameters as flags. The command line and the benchmarks share it."""

from __future__ import annotations

import argparse
import difflib
import math
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from xpnn.backends import BACKENDS
from xpnn.backends.base import DTYPES
from xpnn.data.datasets import DATASETS
from xpnn.errors import PARAM
from xpnn.nn.gpt import GPT_DEFAULTS
from xpnn.nn.losses import LOSSES
from xpnn.nn.models import MLP_ACTIVATIONS
from xpnn.parallel.comm import KINDS
from xpnn.parallel.model.pipeline import SCHEDULES as PIPELINE_SCHEDULES
from xpnn.parallel.plan import MODES as PARALLEL
from xpnn.parallel.plan import NODE_SHARES
from xpnn.parallel.update import DEFAULT_BUCKET_MB
from xpnn.parallel.update.wire import GRAD_DTYPES
from xpnn.record.timeline import parse_steps
from xpnn.run import BATCH, HIDDEN, LR_SCALINGS, MICROBATCHES, SYNTHETIC_SIZE, RunSpec
from xpnn.train.checkpoint import KEEP_CHECKPOINTS
from xpnn.train.graph import CUDA_GRAPH
from xpnn.train.optim import OPTIMIZERS, SCHEDULES
from xpnn.train.precision import PRECISIONS
from xpnn.train.requeue import SIGNALS

__all__ = ["FLAGS", "ArgError", "build_info_parser", "build_parser", "flag_words", "to_spec"]
__all__ += ["typed_settings"]


class ArgError(Exception):
    """A bad flag, in one line naming it (the parser's error, without the usage)."""


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line naming it, with no usage dump, takes no
    abbreviation (``--e 1`` is not ``--epochs 1``) and suggests the flag a typo meant."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ArgError(message.removeprefix("argument "))

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        known, unknown = self.parse_known_args(args, namespace)
        if unknown:
            raise ArgError(self._unknown(unknown))
        return known

    def _unknown(self, unknown: list[str]) -> str:
        """argparse's line, with the closest flag for the first mistyped one (difflib)."""
        flags = [f for action in self._actions for f in action.option_strings]
        line = f"unrecognized arguments: {' '.join(unknown)}"
        for word in unknown:
            typed = word.split("=", 1)[0]
            if typed.startswith("--"):
                # a cut-short flag means the one it begins; else the closest spelling
                close = [f for f in flags if f.startswith(typed)][:1]
                close = close or difflib.get_close_matches(typed, flags, n=1, cutoff=0.6)
                if close:
                    return f"{line} (did you mean {close[0]}?)"
        return line


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


def _or_auto(parse):  # noqa: ANN001, ANN202
    """``parse``, or the word ``auto``: the planner chooses (``xpnn.planner.auto``)."""

    def either(text: str):  # noqa: ANN202
        return "auto" if text == "auto" else parse(text)

    return either


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


def _resume_mode(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"{text!r}: expected auto, or nothing")
    return text


def _path(text: str) -> str:
    """A file or directory name; an empty one is a slip (the shell's ``--save $UNSET``)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty path")
    return text


def _trace_steps(text: str) -> str:
    try:
        parse_steps(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
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


def _shown(default: Any) -> str:
    """A default as the help says it: 0.001, not 1e-3's repr; sizes as the flag takes them."""
    if isinstance(default, tuple):
        return ",".join(map(str, default))
    return f"{default:g}" if isinstance(default, float) else str(default)


_seed = _whole_number(2**64 - 1, "2**64 - 1")  # a checkpoint keeps the seed as a uint64


def build_info_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m xpnn info", description="What this machine offers to xpnn.")
    p.add_argument("--json", action="store_true", help="machine-readable")
    return p


def build_parser() -> argparse.ArgumentParser:
    """A flag per ``RunSpec`` field (``--no-progress`` for ``progress``), with its defaults."""
    p = _Parser(
        prog="python -m xpnn",
        usage="python -m xpnn [train] [flags]  |  --version  |  info [--json]  |  plot "
        "METRICS.jsonl... [-o PNG]  |  trace DIR [-o MERGED]  |  generate CHECKPOINT [--chars N]",
        description="Train a network over xp, alone or under MPI (mpiexec -n N python -m xpnn "
        "...). `python -m xpnn info` says what this machine offers: backends, devices, cores, "
        "the MPI library and whether it is CUDA-aware.",
    )
    a, count = p.add_argument, _positive_int()
    a(
        "--backend",
        choices=BACKENDS,
        help="array library (default auto: cupy where a GPU is usable, else torch where "
        "PyTorch sees an accelerator, else numba); numpy: plain NumPy; numba: NumPy plus "
        "compiled CPU kernels; torch: PyTorch tensors (pip install 'xpnn[torch]')",
    )
    a(
        "--device",
        help="backend torch: auto (default: cuda, xpu, mps, then cpu), cpu, cuda, mps, xpu, or "
        "a PyTorch device such as cuda:1; an accelerator without an index: one per rank",
    )
    a(
        "--model",
        metavar="MODEL",
        help="mlp (default), cnn, gpt (a character-level transformer for --dataset "
        "tinyshakespeare or text), or your own: FILE.py:FUNCTION or package.module:FUNCTION, "
        "a function f(input_shape, num_classes) returning an xpnn.nn.Sequential, imported by "
        "every rank",
    )
    a("--layers", type=count, help=f"gpt: transformer blocks (default {GPT_DEFAULTS['layers']})")
    heads = f"gpt: attention heads a block, dividing --embed (default {GPT_DEFAULTS['heads']})"
    a("--heads", type=count, help=heads)
    a("--embed", type=count, help=f"gpt: embedding width (default {GPT_DEFAULTS['embed']})")
    block = f"gpt: context length in characters (default {GPT_DEFAULTS['block']})"
    a("--block", type=count, help=block)
    a("--hidden", type=_hidden, help=f"MLP hidden sizes (default {_shown(HIDDEN)})")
    a(
        "--activation",
        choices=MLP_ACTIVATIONS,
        help="the MLP's hidden layers' activation (default relu)",
    )
    a(
        "--loss",
        choices=list(LOSSES),
        help="softmax_cross_entropy (default) or sigmoid_bce (one-vs-rest logistic losses)",
    )
    synthetic = "generated separable classes of 1x28x28 images, nothing to download"
    a(
        "--dataset",
        choices=DATASETS,
        help=f"fashion-mnist, mnist, synthetic: {synthetic}; tinyshakespeare and text (a "
        "UTF-8 file as --data-dir) train --model gpt (default fashion-mnist; with --model gpt, "
        "tinyshakespeare)",
    )
    a(
        "--data-dir",
        type=_path,
        help="mnist, fashion-mnist: the directory holding the four IDX files; tinyshakespeare: "
        "the file input.txt, or a directory holding it; text: the UTF-8 file",
    )
    a(
        "--replicate",
        type=count,
        help=f"repeat the training set K times (scaling studies; default {RunSpec.replicate})",
    )
    a(
        "--synthetic-size",
        type=count,
        help=f"--dataset synthetic: training samples ({SYNTHETIC_SIZE:,})",
    )
    a("--epochs", type=count, help=f"passes over the training set (default {RunSpec.epochs})")
    a("--batch-size", help=f"GLOBAL batch size ({BATCH}), or 'full' for full-batch GD")
    a("--per-rank-batch", type=count, help="batch per rank; the global batch is this x the ranks")
    a(
        "--lr",
        type=_float_from(0.0, inclusive=False),
        help=f"learning rate, the largest the schedule reaches (default {_shown(RunSpec.lr)})",
    )
    a(
        "--lr-scaling",
        choices=LR_SCALINGS,
        help="linear: multiply --lr by the number of replicas, the ranks that split a batch "
        "(Goyal et al.; default none)",
    )
    a(
        "--warmup-epochs",
        # past this the warmup's steps (epochs x steps an epoch) overflow a 64-bit count
        type=_float_from(0.0, most=MOST),
        help="raise the rate linearly from ~0 to --lr over E epochs "
        f"(default {_shown(RunSpec.warmup_epochs)})",
    )
    a(
        "--schedule",
        choices=SCHEDULES,
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
        choices=list(OPTIMIZERS),
        help="sgd, momentum (heavy ball), adam, or adamw: Adam with decoupled weight decay on "
        "the weight matrices (default adam)",
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
        f"step in less memory (default {RunSpec.accumulate})",
    )
    a("--steps", type=count, help="train this many steps instead of --epochs")
    a(
        "--eval-every",
        type=count,
        metavar="M",
        help="--steps: evaluate and write a record every M steps (default: at the end)",
    )
    a(
        "--dtype",
        choices=DTYPES,
        help="the parameters' and activations' precision (default float32)",
    )
    a(
        "--precision",
        choices=PRECISIONS,
        help="bf16, fp16: forward and backward in low precision on fp32 master parameters "
        "(fp16 with dynamic loss scaling; default fp32)",
    )
    a(
        "--grad-dtype",
        choices=GRAD_DTYPES,
        help="send the data-parallel gradients between ranks in this float, summed in float32 "
        "(float16 with dynamic loss scaling; default: the parameters' dtype)",
    )
    a(
        "--cuda-graph",
        choices=CUDA_GRAPH,
        help="backend cupy: record the training step once as a CUDA graph and replay it "
        "(default off; auto: where it applies; on: an error where it cannot)",
    )
    seed = f"initial weights, shuffles and dropout masks (default {RunSpec.seed})"
    a("--seed", type=_seed, help=seed)
    a(
        "--threads",
        type=_or_auto(_positive_int(most=4096)),  # past a few thousand, BLAS overflows or crawls
        help="BLAS/Numba threads per rank (default: the cores it may run on, shared with the "
        "node's ranks that may run on them too); auto: the count predicted fastest",
    )
    a(
        "--batch-threads",
        type=_or_auto(_positive_int(most=4096)),
        help="split each rank's batch over K threads, each running its own twin of the model "
        "with --threads / K BLAS threads, their gradients summed: data parallelism inside the "
        "process, for a model too small to keep BLAS threads busy (K divides --threads; "
        f"default {RunSpec.batch_threads}: the threads share each product)",
    )
    a("--metrics", type=_path, help="JSON-lines metrics file (rank 0 writes it)")
    a("--save", type=_path, help="save parameters to FILE.npz at the end")
    a(
        "--checkpoint-dir",
        type=_path,
        help="write the network and optimizer state here after every epoch, or with --steps at "
        "every evaluation (rank 0)",
    )
    a(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        type=_resume_mode,
        metavar="auto",
        help="continue from the latest checkpoint (none there: refused); --resume auto: start "
        "afresh where there is none yet (a requeued job's first run)",
    )
    a(
        "--checkpoint-signal",  # the command line's alone: its exit code 75 is a requeue's cue
        choices=SIGNALS,
        help="on this signal, stop after the step under way and its checkpoint, with exit 75 "
        "(a requeue script's cue; e.g. sbatch --signal=USR1@600)",
    )
    a(
        "--keep-checkpoints",
        type=_whole_number(),
        metavar="K",
        help="keep the newest K checkpoints, deleting older ones once a new one is complete "
        f"(default {KEEP_CHECKPOINTS}; 0 keeps every one)",
    )
    a(
        "--comm",
        choices=[kind for kind in KINDS if kind != "self"],
        help="how ranks exchange gradients (default auto: the fastest that works here)",
    )
    a(
        "--bucket-mb",
        # below ~1 kB a bucket is an allreduce per few values: a step takes seconds
        type=_float_from(0.001, most=2**20),  # a TB bucket is a typo
        help=f"allreduce bucket size in MiB (default {_shown(DEFAULT_BUCKET_MB)}; mpi-host and the "
        "GPU comms)",
    )
    a(
        "--stall-warn",
        type=_float_from(0.0, most=MOST),
        metavar="S",
        help="say where a rank waits once it has waited S seconds for the others in one "
        f"exchange (default {_shown(RunSpec.stall_warn)}; 0: never)",
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
        choices=NODE_SHARES,
        help="mpi-shm: what the ranks of a node share, their gradients (summed by the update) "
        "or the batch's activations (each rank computes some rows of every gradient; MLPs "
        "only); auto (default): activations when they are fewer values than the parameters",
    )
    a(
        "--parallel",
        choices=(*PARALLEL, "auto"),
        help="data: each rank a share of every batch; tensor: each rank a slice of every "
        "pair of layers that declare a split (an MLP's Dense layers, a GPT's heads and MLPs); "
        "pipeline: each rank a run of consecutive layers; auto: the one predicted fastest "
        "(python -m xpnn plan) (default data)",
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
        choices=list(PIPELINE_SCHEDULES),
        help="--parallel pipeline: gpipe (all forwards, then all backwards; the default) or "
        "1f1b (a forward and a backward in turn: activations of at most stages - s "
        "micro-batches held, not M)",
    )
    a(
        "--tensor-ranks",
        type=count,
        help="--parallel pipeline: ranks that split each stage tensor-parallel (default 1); "
        "--model-ranks K makes K / T stages, N / K replicas (3-D parallelism)",
    )
    a(
        "--recompute",
        action="store_true",
        help="--parallel pipeline: keep each micro-batch's stage input, not its activations, "
        "and run its forward again before its backward (less memory, one more forward)",
    )
    a(
        "--shard-optimizer",
        action="store_true",
        help="keep 1/N of the optimizer state on each of N data-parallel ranks (ZeRO stage 1): "
        "each rank updates its shard of the parameters, then every shard is sent to every rank",
    )
    a("--no-progress", action="store_true", help="no progress bar even on a terminal")
    a(
        "--trace",
        type=_path,
        metavar="DIR",
        help="every rank writes DIR/trace-rankN.json, a timeline (Chrome trace events) of "
        "--trace-steps; python -m xpnn trace DIR merges them",
    )
    a(
        "--trace-steps",
        type=_trace_steps,
        metavar="A:B",
        help="--trace: steps A to B-1, counted over the run from 0 (default: 5 steps from "
        "step 3, earlier in a shorter run)",
    )
    p.set_defaults(**{f.name: getattr(RunSpec, f.name) for f in fields(RunSpec)})
    return p


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


UNSET = object()  # a flag's value before the command line sets it


def typed_settings(parser: argparse.ArgumentParser, argv: list[str]) -> frozenset[str]:
    """The ``RunSpec`` fields whose flags ``argv`` types (parsed again with no defaults)."""
    probe = argparse.Namespace(**{f.name: UNSET for f in fields(RunSpec)})
    parser.parse_args(argv, namespace=probe)
    return frozenset(name for name, value in vars(probe).items() if value is not UNSET)
