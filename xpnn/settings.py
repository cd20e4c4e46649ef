"""Every setting of a run declared once, as a ``RunSpec`` field; parser, checks, docs read them."""

import dataclasses
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from xpnn.backends import BACKENDS, accelerator_possible
from xpnn.backends.base import DTYPES
from xpnn.data.datasets import DATASETS
from xpnn.data.text import TEXT_DATASETS
from xpnn.errors import UserError
from xpnn.nn.gpt import GPT_DEFAULTS
from xpnn.nn.layer import is_int
from xpnn.nn.losses import LOSSES
from xpnn.nn.models import HIDDEN, MLP_ACTIVATIONS
from xpnn.parallel.comm import KINDS
from xpnn.parallel.comm.narrow import GRAD_DTYPES
from xpnn.parallel.model import pipeline
from xpnn.parallel.model.batch_threads import CPU_BACKENDS
from xpnn.parallel.plan import MODES, NODE_SHARES, check
from xpnn.parallel.update import DEFAULT_BUCKET_MB
from xpnn.planner.auto import AUTO, CHOSEN
from xpnn.runtime.stall import STALL_WARN_S
from xpnn.train.checkpoint import KEEP_CHECKPOINTS
from xpnn.train.graph import CUDA_GRAPH
from xpnn.train.optim import HYPER_PARAMETERS, HYPERS, OPTIMIZERS, SCHEDULES
from xpnn.train.precision import PRECISIONS

BATCH = 128  # the global batch when neither batch_size nor per_rank_batch is given
MICROBATCHES = 4  # GPipe's default for parallel="pipeline"
MOST = 2**31 - 1  # counts and sizes past this are typos, and past NumPy's or C's int types


@dataclass(frozen=True)
class Range:
    """A number's rule, said to a program (``problem``) and read from a flag's text (``read``)."""

    low: float
    most: float = math.inf
    above: bool = False  # ``low`` itself refused
    whole: bool = False
    below: float | None = None  # refused from here up (a decay rate's 1)
    most_said: str = ""  # ``most`` as the message writes it

    def problem(self, value: Any) -> str | None:
        bound = f"{'>' if self.above else '>='} {self.low:g}"
        if self.whole and (not is_int(value) or value < self.low):
            return f"must be a whole number {bound}, got {value!r}"
        number = isinstance(value, int | float) and math.isfinite(value)
        if not self.whole and (not number or not self._low_ok(value)):
            return f"must be a finite number {bound}, got {value!r}"
        return self._high(value, repr(value))

    def read(self, text: str) -> int | float:
        try:
            value = int(text) if self.whole else float(text)
        except ValueError:
            kind = "an integer" if self.whole else "a number"
            raise ValueError(f"not {kind}: {text!r}") from None
        if self.whole:
            if self.low == 0 and not 0 <= value <= self.most:
                raise ValueError(f"must be from 0 to {self.most_said or self.most}, got {value}")
            if value < self.low:
                raise ValueError(f"must be at least {self.low}, got {value}")
        elif not self._low_ok(value):  # also refuses nan
            raise ValueError(f"must be {'>' if self.above else '>='} {self.low:g}, got {text}")
        elif math.isinf(value):
            raise ValueError(f"must be finite, got {text}")
        if problem := self._high(value, str(value) if self.whole else text):
            raise ValueError(problem)
        return value

    def _high(self, value: float, shown: str) -> str | None:
        if self.below is not None and value >= self.below:
            return f"must be below {self.below:g}, got {shown}"
        if value > self.most:
            return f"must be at most {self.most_said or f'{self.most:.10g}'}, got {shown}"
        return None

    def _low_ok(self, value: float) -> bool:
        return value > self.low if self.above else value >= self.low


COUNT = Range(1, MOST, whole=True)
COUNT0 = Range(0, MOST, whole=True)  # a count that may be 0
POSITIVE = Range(0, above=True)
RATE = Range(0, below=1)  # a decay rate: momentum, Adam's betas
THREADS = Range(1, 4096, whole=True)  # past a few thousand, BLAS overflows or crawls


@dataclass(frozen=True)
class Setting:
    """One setting's declaration, kept in its ``RunSpec`` field's metadata."""

    group: str  # its table in docs/cli.md, and its place in ``--help``
    help: str  # docs/cli.md's words, code in double backticks; ``--help`` drops the marks
    rule: Range | None = None
    choices: Collection[str] = ()
    unoffered: Collection[str] = ()  # choices a program may give, not the command line
    read: str = ""  # how the flag's text is read where not by ``rule``: sizes, rates, path...
    metavar: str | None = None
    flag: str = ""  # default: --name-with-dashes
    shown: str = ""  # the default as the docs say it (default: the value, or ``fill``)
    fill: Any = None  # what None stands for: a value, or a function of the spec
    per_rank: bool = False  # may differ between ranks: a node's data copy, rank 0's files, cores

    def said_default(self, default: Any) -> str:
        if self.shown:
            return self.shown
        value = default if self.fill is None or callable(self.fill) else self.fill
        if value is None or value is False:
            return "none" if value is None else "off"
        return f"``{said(value)}``"


def declare(group: str, default: Any, **how: Any) -> Callable[[str], Any]:
    """``MODEL(default, **declaration)(help)`` declares a field in the table ``group``."""
    return lambda help: field(default=default, metadata={"setting": Setting(group, help, **how)})


TITLES = ["Model", "Data", "Training", "Outputs and checkpoints"]  # docs/cli.md's tables
TITLES += ["Parallelism and communication", "Watching a job"]
MODEL, DATA, TRAINING, OUTPUTS, PARALLEL, WATCHING = (partial(declare, t) for t in TITLES)


def node_share(spec: Any) -> str:
    """Shared activations hold a rank's whole part of a batch: not a batch thread's."""
    return "auto" if (spec.precision, spec.batch_threads) == ("fp32", 1) else "gradients"


# --model gpt: nanoGPT's small-model recipe, for the settings the user leaves unset
GPT_RECIPE: dict[str, Any] = {"optimizer": "adamw", "betas": (0.9, 0.95), "eps": 1e-8}
GPT_RECIPE |= {"weight_decay": 0.1, "lr": 1e-3, "schedule": "cosine", "warmup_steps": 100}
GPT_RECIPE |= {"min_lr": 1e-4, "clip_norm": 1.0, "batch_size": 32, "dataset": "tinyshakespeare"}


def said(value: Any) -> str:
    """A value as a flag takes it: 0.001, not 1e-3's repr; pairs and sizes with commas."""
    if isinstance(value, tuple | list):
        return ",".join(map(said, value))
    return f"{value:g}".replace("e-0", "e-") if isinstance(value, float) else str(value)


GPT_FLAGS = " ".join(f"--{k.replace('_', '-')} {said(v)}" for k, v in GPT_RECIPE.items())


@dataclass
class RunSpec:
    """The choices of one run; ``None`` is "the default", so that an ignored one can be said."""

    backend: str = MODEL(
        "auto", choices=BACKENDS, shown="``auto``: the fastest this machine offers"
    )(
        "Array library. ``auto`` (the default) takes the fastest one the machine offers, and the "
        "header line says which (``backend numba (auto, cpu, float32)``); ``numpy`` is plain "
        "NumPy; ``numba`` is NumPy plus compiled CPU kernels; ``cupy`` runs on an NVIDIA GPU; "
        "``torch`` runs on PyTorch tensors, on any device PyTorch reaches (``pip install "
        '"xpnn[torch]"``, see [PyTorch tensors](torch.md)); ``auto`` is ``cupy`` where a GPU is '
        "usable, else ``torch`` where PyTorch sees an accelerator (CUDA, ROCm, MPS, XPU), else "
        "``numba``."
    )
    device: str | None = MODEL(None, metavar="DEVICE", shown="``auto``")(
        "``--backend torch`` only: ``cpu``, ``cuda`` (also AMD GPUs on a ROCm build of PyTorch), "
        "``mps`` (Apple GPUs), ``xpu`` (Intel GPUs), or a PyTorch device such as ``cuda:1``. "
        "``auto`` takes the first of ``cuda``, ``xpu``, ``mps`` that PyTorch sees, else ``cpu``; "
        "an accelerator named without an index gives each rank its own (local rank modulo the "
        "devices). Another backend with ``--device`` is an error."
    )
    model: Any = MODEL("mlp", metavar="MODEL")(
        "``mlp``, ``cnn``, ``gpt`` (see ``--layers``), or your own network: ``FILE.py:FUNCTION`` "
        "or ``package.module:FUNCTION``, a function ``f(input_shape, num_classes)`` returning an "
        "unbuilt ``xpnn.nn.Sequential`` (or any ``xpnn.nn.Model``: data parallelism only, see "
        "[the model API](model-api.md)), imported by every rank (see the [tutorial](tutorial.md)). "
        "Every other flag applies to it as to a preset. A path or function that is not there, or a "
        "factory that raises, is one line naming ``--model`` (exit 2). ``cnn`` is the "
        "690,590-parameter network of the MPI deep-learning report: three valid 3×3 convolutions "
        "(32, 128, 256 channels), each with ReLU and 2×2 max-pooling, dropout 0.5, Dense 1000, "
        "100, 10."
    )
    hidden: tuple[int, ...] | None = MODEL(None, metavar="SIZES", read="sizes", fill=HIDDEN)(
        "The MLP's hidden layer sizes, comma-separated."
    )
    layers: int | None = MODEL(None, rule=COUNT, metavar="L", fill=GPT_DEFAULTS["layers"])(
        "``--model gpt``: transformer blocks. ``gpt`` is a character-level GPT: token and learned "
        "position embeddings, L pre-LayerNorm blocks (causal multi-head self-attention, then a 4x "
        "wide GELU MLP, each around a residual), a final LayerNorm and a vocabulary head, trained "
        "with softmax cross-entropy at every position. Its defaults are the recipe of nanoGPT's "
        "small models, for each of these settings not given on the command line: "
        f"``{GPT_FLAGS}`` (a flag given wins, and the start-up lines name the settings the recipe "
        "filled)."
    )
    heads: int | None = MODEL(None, rule=COUNT, metavar="H", fill=GPT_DEFAULTS["heads"])(
        "``--model gpt``: attention heads a block; must divide ``--embed``."
    )
    embed: int | None = MODEL(None, rule=COUNT, metavar="D", fill=GPT_DEFAULTS["embed"])(
        "``--model gpt``: embedding width."
    )
    block: int | None = MODEL(None, rule=COUNT, metavar="T", fill=GPT_DEFAULTS["block"])(
        "``--model gpt``: context length in characters, the length of the training windows."
    )
    activation: str | None = MODEL(None, choices=MLP_ACTIVATIONS, fill="relu")(
        "The MLP's hidden activation."
    )
    loss: str = MODEL("softmax_cross_entropy", choices=tuple(LOSSES))(
        "``sigmoid_bce`` trains one-vs-rest logistic outputs in place of the softmax."
    )
    dtype: str = MODEL("float32", choices=DTYPES)("Parameters' and activations' type.")
    precision: str = MODEL("fp32", choices=PRECISIONS)(
        "``bf16``, ``fp16``: forward and backward on a low-precision copy of the parameters, with "
        "the master parameters, their gradients' exchange and the optimizer state in ``--dtype`` "
        "(``fp16`` with dynamic loss scaling); data parallelism only. See [Mixed "
        "precision](precision.md)."
    )
    cuda_graph: str = MODEL("off", choices=CUDA_GRAPH)(
        "``--backend cupy``: record the training step once as a CUDA graph and replay it every "
        "step (the same kernels in the same order: the same results). ``auto``: wherever it "
        "applies (data parallelism, ``--precision fp32``, ``--accumulate 1``, no ``--grad-dtype "
        "float16``), else off without a word; ``on``: exit 2 naming why where it cannot apply. See "
        "[CUDA graphs](gpu.md#the-training-step-as-a-cuda-graph)."
    )
    seed: int = MODEL(0, rule=Range(0, 2**64 - 1, whole=True, most_said="2**64 - 1"), metavar="S")(
        "Initial weights, shuffles and dropout masks; 0 to 2⁶⁴ − 1."
    )
    dataset: str = DATA(
        "fashion-mnist",
        choices=DATASETS,
        shown="``fashion-mnist``; with ``--model gpt``, ``tinyshakespeare``",
    )(
        "``synthetic`` is a deterministic, learnable 10-class set that needs no files. "
        "``tinyshakespeare`` (1,115,394 characters, downloaded from karpathy/char-rnn and checked "
        "against its SHA-256, then cached) and ``text`` (any UTF-8 file as ``--data-dir``) train "
        "``--model gpt``: see [Text data](#text-data)."
    )
    data_dir: str | None = DATA(None, read="path", metavar="DIR", per_rank=True)(
        "A directory holding the four IDX files (``.gz`` or not). Without it, see [Getting "
        "started](getting-started.md#data-offline-and-online). ``tinyshakespeare``: the directory "
        "holding ``input.txt`` (or the file); ``text``: the file."
    )
    synthetic_size: int | None = DATA(None, rule=COUNT, metavar="N", fill=6000)(
        "Training samples of ``--dataset synthetic``."
    )
    replicate: int = DATA(1, rule=COUNT, metavar="K")(
        "Repeat the training set K times (weak-scaling studies); the samples are not copied."
    )
    epochs: int = TRAINING(5, rule=COUNT, metavar="N")(
        "Epochs to train; with ``--resume``, the total to reach."
    )
    batch_size: int | str | None = TRAINING(None, metavar="GLOBAL", shown=f"``{BATCH}``")(
        "The global batch, split across ranks; ``full`` is full-batch gradient descent. The run's "
        "mathematics do not depend on the number of ranks."
    )
    per_rank_batch: int | None = TRAINING(None, rule=COUNT, metavar="B")(
        "Makes the global batch B × replicas (weak scaling). Not together with ``--batch-size``."
    )
    lr: float = TRAINING(1e-3, rule=POSITIVE, metavar="X")("Learning rate.")
    lr_scaling: str = TRAINING("none", choices=("none", "linear"))(
        "``linear`` multiplies ``--lr`` by the number of replicas (Goyal et al., 2017)."
    )
    steps: int | None = TRAINING(None, rule=COUNT, metavar="N")(
        "Train N steps (global batches) instead of ``--epochs``, through as many epochs' shuffles "
        "as they take. With ``--checkpoint-dir``, a checkpoint at every evaluation "
        "(``--eval-every``)."
    )
    eval_every: int | None = TRAINING(None, rule=COUNT, metavar="M", shown="at the end")(
        "With ``--steps``: evaluate every M steps, each evaluation an ``eval`` record in the "
        "metrics file."
    )
    warmup_epochs: float = TRAINING(0.0, rule=Range(0, MOST), metavar="E")(
        "Raise the rate linearly from ~0 to ``--lr`` over E epochs (at least one step if E > 0)."
    )
    warmup_steps: int | None = TRAINING(None, rule=COUNT0, metavar="N", shown="``0``")(
        "The warmup in steps instead of epochs; not together with ``--warmup-epochs``."
    )
    schedule: str = TRAINING("constant", choices=SCHEDULES)(
        "``step``: × 0.1 every ``--step-epochs`` epochs; ``cosine``: half a cosine from ``--lr`` "
        "down to ``--min-lr`` over the steps after warmup."
    )
    min_lr: float | None = TRAINING(None, rule=Range(0), metavar="X", fill=0.0)(
        "The rate ``--schedule cosine`` ends at (at most ``--lr``)."
    )
    step_epochs: int | None = TRAINING(
        None,
        rule=COUNT,
        metavar="E",
        fill=lambda spec: max(1, spec.epochs // 3),
        shown="a third of ``--epochs``",
    )("Epochs between decays of ``--schedule step``.")
    optimizer: str = TRAINING("adam", choices=tuple(OPTIMIZERS))(
        "SGD, SGD with momentum, Adam, or AdamW: Adam with decoupled weight decay on the weight "
        "matrices."
    )
    momentum: float | None = TRAINING(None, rule=RATE, metavar="MU", shown="``0.9``")(
        "``--optimizer momentum``: ``v = MU v + g; p -= lr v`` (PyTorch's convention)."
    )
    betas: tuple[float, float] | None = TRAINING(
        None, read="rates", metavar="B1,B2", shown="``0.9,0.999``"
    )(
        "``--optimizer adam``/``adamw``: the decay rates of the gradient's running mean and of its "
        "square."
    )
    eps: float | None = TRAINING(None, rule=POSITIVE, metavar="X", shown="``1e-8``")(
        "``--optimizer adam``/``adamw``: added to the square root of the running square."
    )
    weight_decay: float | None = TRAINING(None, rule=Range(0), metavar="WD", shown="``0.01``")(
        "``--optimizer adamw``: before each step, parameters with two or more dimensions (weight "
        "matrices, convolution kernels) are multiplied by ``1 - lr × WD``; biases never (as "
        "``torch.optim.AdamW`` with two parameter groups)."
    )
    clip_norm: float | None = TRAINING(None, rule=POSITIVE, metavar="C")(
        "Scale each step's gradient down to a global L2 norm of C when it is larger "
        "(``torch.nn.utils.clip_grad_norm_``'s formula). The norm is the whole model's, summed "
        "over tensor slices and pipeline stages once each, so it is the same on any number of "
        "ranks. Each update then waits for the whole reduced gradient."
    )
    accumulate: int = TRAINING(1, rule=COUNT, metavar="K")(
        "Take each global batch in K micro-steps (each rank's share of the batch cut in K), "
        "summing their gradients before the update: the same step in less activation memory. N "
        "ranks × K micro-steps compute the 1-rank run with the same ``--batch-size``."
    )
    threads: int | str | None = TRAINING(
        None, rule=THREADS, metavar="T", shown="the rank's cores", per_rank=True
    )(
        "BLAS and Numba threads per rank. By default each rank takes the cores it may run on "
        "(affinity mask and CPU quota), shared with the node's ranks that may run on them too. "
        "``auto``: the count the planner predicts fastest "
        "([Planning](planning.md#auto-the-choice-made-for-you))."
    )
    batch_threads: int | str = TRAINING(1, rule=THREADS, metavar="K")(
        "Split each rank's share of a batch over K threads (K divides ``--threads T``), each "
        "running its own twin of the model (the parameters shared, its own gradients) with ``T / "
        "K`` BLAS threads and Numba's kernels on itself alone; the gradients are summed in thread "
        "order. Data parallelism inside the process, for models too small to keep several BLAS "
        "threads busy, such as the GPT ([gpt.md](gpt.md#speed-beside-pytorch)). The result equals "
        "the one-thread run up to the order of additions, for layers that treat each sample alone. "
        "CPU backends (``numpy``, ``numba``), ``--parallel data`` and ``--precision fp32`` only; "
        "with it ``--node-share`` defaults to gradients. A ``--trace`` shows the main thread's "
        "part. ``auto``: the count predicted fastest."
    )
    progress: bool = TRAINING(True, flag="--no-progress", shown="off", per_rank=True)(
        "No progress bar (rank 0 shows one only on a terminal anyway)."
    )
    metrics: str | None = OUTPUTS(None, read="path", metavar="FILE.jsonl", per_rank=True)(
        "JSON lines, written by rank 0: one object per epoch and one at the end (below), each line "
        "whole. A fresh run empties the file when training starts; a resumed run drops the lines "
        "of epochs after its checkpoint, then appends. A file that exists and is not an xpnn "
        "metrics file is refused."
    )
    save: str | None = OUTPUTS(None, read="path", metavar="FILE.npz", per_rank=True)(
        "Every parameter at the end under a stable name (``layer0.W``, ``layer0.b``, …), loadable "
        "with ``numpy.load(FILE, allow_pickle=False)``."
    )
    checkpoint_dir: str | None = OUTPUTS(None, read="path", metavar="DIR", per_rank=True)(
        "Write ``checkpoint-epochNNNN.npz`` after every epoch (with ``--steps``, "
        "``checkpoint-epochNNNN-stepSSSSSSSS.npz`` at every evaluation): parameters, optimizer "
        "state, epoch, step, seed, data set and settings, atomically. A new run refuses a "
        "directory holding another run's checkpoints; any job refuses a directory that a live job "
        "holds (``DIR/.xpnn-lock`` names it)."
    )
    resume: bool | str = OUTPUTS(False, read="resume", metavar="auto")(
        "Continue from the latest checkpoint in ``--checkpoint-dir``; the result is the "
        "uninterrupted run's. Where there is no checkpoint (a mistyped directory), refused, exit "
        "2; ``--resume auto`` starts afresh there instead (a requeued job's first run). A resume "
        "with nothing left to train writes no second ``done`` record. May change ranks, "
        "parallelism, ``--epochs`` and the rates to come (the resume line names changed rates and "
        "precision; a checkpoint does not record the ranks or the parallelism that wrote it, being "
        "the same file whichever did)."
    )
    keep_checkpoints: int | None = OUTPUTS(None, rule=COUNT0, metavar="K", fill=KEEP_CHECKPOINTS)(
        "Keep the newest K checkpoints in ``--checkpoint-dir``, deleting older ones once a new one "
        "is complete; ``0`` keeps every one."
    )
    parallel: str = PARALLEL("data", choices=(*MODES, AUTO))(
        "``data``: each rank a share of every batch; ``tensor``: each rank a slice of every pair "
        "of Dense layers (MLP only); ``pipeline``: each rank a run of consecutive layers; "
        "``auto``: the one predicted fastest, said in the header, kept by a resume. See "
        "[Parallelism](parallelism.md)."
    )
    model_ranks: int | None = PARALLEL(None, rule=COUNT, metavar="K", shown="all ranks")(
        "With ``tensor`` or ``pipeline``: ranks holding one replica; N ranks train N / K replicas "
        "data-parallel (2-D)."
    )
    tensor_ranks: int | None = PARALLEL(None, rule=COUNT, metavar="T", fill=1)(
        "With ``pipeline`` and ``--model gpt``: each stage is split over T ranks tensor-parallel "
        "(heads and MLP columns, as ``tensor`` splits them); a replica of K ranks is K / T stages, "
        "and N ranks train N / K replicas (3-D parallelism)."
    )
    microbatches: int | None = PARALLEL(None, rule=COUNT, metavar="M", fill=MICROBATCHES)(
        "Pipeline: micro-batches per global batch."
    )
    pipeline_schedule: str | None = PARALLEL(
        None, choices=tuple(pipeline.SCHEDULES), fill=pipeline.DEFAULT_SCHEDULE
    )(
        "Pipeline: all forwards then all backwards (``gpipe``), or a forward and a backward in "
        "turn, holding at most S − s micro-batches' activations (``1f1b``)."
    )
    recompute: bool | None = PARALLEL(None, fill=False)(
        "Pipeline: keep each micro-batch's stage input only and run its forward again before its "
        "backward (less memory, one more forward)."
    )
    comm: str = PARALLEL("auto", choices=KINDS, unoffered=("self",))(
        "How ranks exchange gradients. ``auto``: one process needs none; CPU backends use "
        "``mpi-shm`` for data parallelism when every node runs the same number of ranks, else "
        "``mpi-host`` (always ``mpi-host`` between the ranks of a tensor- or pipeline-parallel "
        "replica, where ``mpi-shm`` is an error); ``cupy`` uses ``nccl`` with a GPU per rank, else "
        "``mpi-cuda`` on a CUDA-aware MPI, else ``mpi-host``; ``torch`` uses ``mpi-host`` on the "
        "CPU (node-shared memory holds NumPy arrays: ``mpi-shm`` is an error) and on a CUDA device "
        "``mpi-cuda`` where MPI is CUDA-aware, else ``mpi-host`` (NCCL is reached through CuPy, so "
        "not for ``torch``). See [GPU](gpu.md)."
    )
    bucket_mb: float | None = PARALLEL(
        None,
        rule=Range(0.001, 2**20),
        metavar="MB",
        fill=DEFAULT_BUCKET_MB,
        shown=f"``{DEFAULT_BUCKET_MB:g}``; at least 0.001",
    )("Allreduce bucket size in MiB (``mpi-host`` and the GPU transports).")
    grad_dtype: str | None = PARALLEL(
        None, choices=GRAD_DTYPES, shown="the parameters' (``--dtype``)"
    )(
        "The float the data-parallel gradients are sent between ranks in: each bucket cast before "
        "it is sent and back after, the sum taken in float32 (``bfloat16`` and ``float16`` send 2 "
        "bytes a value, half of float32's 4; ``float32`` halves float64's). ``float16`` is sent "
        "times the loss scale and skips a step whose sum overflows, as ``--precision fp16`` does. "
        "Data parallelism only; with ``mpi-shm`` only the sums between nodes are sent, so on one "
        "node it has no effect (said in a note). See [Mixed "
        "precision](precision.md#the-gradient-exchange-in-low-precision)."
    )
    node_share: str | None = PARALLEL(None, choices=NODE_SHARES, fill=node_share, shown="``auto``")(
        "``mpi-shm``: whether the ranks of a node share gradient rows, or the batch's activations "
        "(MLPs only). ``auto`` shares activations when they are fewer values than the parameters."
    )
    shard_optimizer: bool = PARALLEL(False)(
        "Keep 1/N of the optimizer state on each of N data-parallel ranks (ZeRO stage 1): each "
        "rank updates its shard of the parameters, then sends it to every rank. The same "
        "parameters as one rank; checkpoints hold the whole state, so any rank count resumes them. "
        "With ``--model-ranks K``, each slice or stage is sharded over the N / K replicas. Over "
        "``mpi-host`` (what ``auto`` picks on CPUs) or a GPU transport, ``--precision fp32``, no "
        "``--grad-dtype``; see [Sharded optimizer](parallelism.md#sharded-optimizer)."
    )
    stall_warn: float = WATCHING(STALL_WARN_S, rule=Range(0, MOST), metavar="S")(
        "Once a rank has waited S seconds for the others in one exchange, say where it waits: the "
        "step, the phase and the bucket, once. ``0`` turns it off."
    )
    stall_abort: float = WATCHING(0.0, rule=Range(0, MOST), metavar="S", shown="``0`` (never)")(
        "End the job, exit 124, once a rank has waited S seconds in one exchange, naming the ranks "
        "that waited, the operation they wait in and the rank that never entered it (e.g. 600 on a "
        "cluster)."
    )
    trace: str | None = WATCHING(None, read="path", metavar="DIR", per_rank=True, shown="off")(
        "Every rank writes ``DIR/trace-rankN.json``, a timeline of ``--trace-steps`` in Chrome's "
        "trace-event format: layers, loss, update, every allreduce, send and receive, the waits, "
        "copies, pipeline micro-batches. Merge with ``python -m xpnn trace DIR``; see "
        "[Tracing](tracing.md)."
    )
    trace_steps: str | None = WATCHING(None, read="steps", metavar="A:B", shown="``3:8``")(
        "``--trace``: steps A to B-1, counted over the run from 0; a run shorter than 8 steps is "
        "traced from an earlier step."
    )


SETTINGS: dict[str, Setting] = {f.name: f.metadata["setting"] for f in dataclasses.fields(RunSpec)}
DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunSpec)}
PER_RANK = tuple(name for name, s in SETTINGS.items() if s.per_rank)


def check_settings(spec: RunSpec) -> None:
    """Each setting against its own rule; None is "not given", ``auto`` the planner's."""
    for name, s in SETTINGS.items():
        value = getattr(spec, name)
        if value is None or (name in CHOSEN and value == AUTO):
            continue
        if s.rule and (problem := s.rule.problem(value)):
            raise UserError(f"`{name}`: {problem}")
        if s.choices and value not in s.choices:
            raise UserError(f"`{name}` {value!r}: choose one of {', '.join(s.choices)}")


def check_spec(spec: RunSpec) -> None:
    """Every setting's own rule, then the pairs that cannot go together."""
    check_settings(spec)
    if spec.resume not in (True, False, "auto"):
        raise UserError(f"`resume` {spec.resume!r}: expected True, False or 'auto'")
    if spec.resume and not spec.checkpoint_dir:
        raise UserError("`resume`: needs `checkpoint_dir`")
    if not any(getattr(spec, name) == AUTO for name in CHOSEN):  # auto's tries are checked
        check(spec)  # the combinations: the plan's
    if spec.warmup_steps is not None and spec.warmup_epochs > 0:
        raise UserError("`warmup_steps` and `warmup_epochs`: give one")


def with_defaults(spec: RunSpec) -> RunSpec:
    """``spec`` with each setting it leaves ``None`` given its default (a recipe fills first)."""
    unset = {
        name: s.fill(spec) if callable(s.fill) else s.fill
        for name, s in SETTINGS.items()
        if s.fill is not None and getattr(spec, name) is None
    }
    return dataclasses.replace(spec, **unset)


def given_settings(spec: Any, given: Collection[str] | None = None) -> set[str]:
    """The settings the caller chose: ``given``, else those of ``spec`` off their defaults."""
    if given is not None:
        return set(given)
    return {name for name, value in DEFAULTS.items() if getattr(spec, name) != value}


def gpt_preset(spec: Any, given: Collection[str] | None = None) -> tuple[Any, dict[str, Any]]:
    """(``spec`` with the GPT recipe filling what it leaves unset, what was filled)."""
    if spec.model != "gpt":
        return spec, {}
    given = given_settings(spec, given)
    optimizer = spec.optimizer if "optimizer" in given else GPT_RECIPE["optimizer"]
    schedule = spec.schedule if "schedule" in given else GPT_RECIPE["schedule"]
    applies = {name: name in HYPER_PARAMETERS[optimizer] for name in HYPERS}
    applies |= {"warmup_steps": "warmup_epochs" not in given, "min_lr": schedule == "cosine"}
    applies["batch_size"] = "per_rank_batch" not in given
    fill = {k: v for k, v in GPT_RECIPE.items() if applies.get(k, True) and k not in given}
    spec = dataclasses.replace(spec, **fill)
    if gpt_batch_threads_chosen(spec, given):  # the planner's choice, said in its own line
        spec = dataclasses.replace(spec, batch_threads=AUTO)
    return spec, fill


def gpt_batch_threads_chosen(spec: Any, given: Collection[str]) -> bool:
    """Whether ``--model gpt`` leaves ``batch_threads`` to the planner: where it applies."""
    unset = "batch_threads" not in given and spec.batch_threads == 1 and spec.threads != 1
    if not unset or spec.precision != "fp32" or spec.parallel not in ("data", AUTO):
        return False
    heads, embed = (getattr(spec, n) or GPT_DEFAULTS[n] for n in ("heads", "embed"))
    if spec.dataset not in TEXT_DATASETS or embed % heads:
        return False
    return spec.backend in CPU_BACKENDS or (spec.backend == "auto" and not accelerator_possible())
