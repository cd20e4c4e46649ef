"""A run from its choices: ``build_run`` assembles a ``Trainer``, ``run`` the whole job."""

import dataclasses
import functools
import sys
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np

from xpnn import settings
from xpnn.backends import get_backend
from xpnn.data import load_dataset
from xpnn.data.datasets import check_same_data
from xpnn.errors import UserError, user_message
from xpnn.nn.gpt import GPT_DEFAULTS
from xpnn.nn.models import MODELS, LayeredModel, build_model, check_fits, check_model, model_name
from xpnn.outputs import check_paths
from xpnn.parallel.comm.narrow import sends_gradients
from xpnn.parallel.model.batch_threads import check_batch_threads
from xpnn.parallel.model.whole import is_spread, portion, whole_size
from xpnn.parallel.plan import Plan
from xpnn.parallel.update import uses_byte_buckets
from xpnn.planner import auto
from xpnn.runtime import failure, stall
from xpnn.runtime.failure import agree_on_user_errors
from xpnn.runtime.interrupts import SAID
from xpnn.runtime.threads import (
    HANDOFF_IN_FORCE,
    REPLACED_ENV,
    apply_threads,
    check_network_fits,
    describe_threads,
    node_cores,
    preset_parameters,
    threads_per_rank,
)
from xpnn.runtime.world import describe_ranks, init_world
from xpnn.settings import BATCH, RunSpec
from xpnn.train import RunFacts, TrainConfig, Trainer, TrainingDiverged
from xpnn.train.callbacks import run_callbacks
from xpnn.train.checkpoint import start
from xpnn.train.optim import HYPER_PARAMETERS, HYPERS, OPTIMIZERS
from xpnn.train.trace import observers

Say = Callable[[str], None] | None  # where rank 0's lines go (default: print)
Given = Collection[str] | None  # the settings the user chose (None: those off their defaults)


class RunFailed(RuntimeError):
    """The job stopped, its reason already said in one line; ``exit_code`` as the CLI's."""

    def __init__(self, exit_code: int, reason: str | None = None) -> None:
        said = f"{reason} (exit code {exit_code})" if reason else f"exit code {exit_code}"
        super().__init__(f"the run failed: {said}")
        self.exit_code, self.reason = exit_code, reason


def run(spec: RunSpec, callbacks: Sequence[Any] = (), log: Say = None, warn: Say = None) -> dict:
    """Run ``spec`` on every rank: the final metrics record, or ``RunFailed`` if any rank fails."""
    outcome: dict[str, Any] = {}
    SAID.clear()
    if code := launch(spec, callbacks, log, warn, outcome):
        raise RunFailed(code, SAID[-1].removeprefix("xpnn: ") if SAID else None)
    return outcome["done"]


def launch(
    spec: RunSpec,
    callbacks: Sequence[Any] = (),
    log: Say = None,
    warn: Say = None,
    outcome: dict[str, Any] | None = None,
    given: Given = None,
) -> int:
    """``run`` as the command line's exit code, every rank stopping with one code."""
    stall.set_limits(spec.stall_warn, spec.stall_abort)  # the setup's waits too
    # a typo in these would hide a failure: said once MPI is up, by every rank together
    problem: str | None = None
    for check in (failure.stop_grace, failure.agree_timeout):
        try:
            check()
        except UserError as exc:
            problem = problem or user_message(exc)
    # before MPI_Init: a signal while a rank waits there for another ends it too
    failure.stop_when_stuck(failure.STOP_GRACE_S if problem else failure.stop_grace())
    world = init_world()
    failure.terminate_on_sigterm()  # Slurm's time limit: stop as on Ctrl-C, checkpoints whole
    out = {} if outcome is None else outcome

    def job() -> int:
        failure.agree_to_start(world, "train", problem)  # first: a rank may have failed already
        if problem:
            raise UserError(problem)
        say = log or (lambda line: print(line, flush=True))
        note = warn or (lambda line: print(line, file=sys.stderr, flush=True))
        failure.agree_on_user_errors(world, lambda: check_paths(spec, writer=world.rank == 0))
        trainer = build_run(spec, world, callbacks, log=say, given=given)
        if world.rank == 0:
            for line in summary(trainer, spec.backend, world):
                say(f"xpnn: {line}")
            preset = settings.gpt_preset(spec, given)[0]  # notes on a preset's settings too
            for line in notes(preset, trainer, world):
                note(f"xpnn: note: {line}")
        # A loss gone to inf/NaN is reported once, after its epoch: not per NumPy operation.
        gone = r"(overflow|invalid value|divide by zero) encountered"
        warnings.filterwarnings("ignore", gone, RuntimeWarning, r"xpnn\.")
        try:
            out["done"] = trainer.run()
            if world.size > 1:  # no rank leaves xpnn's signal handling for MPI_Finalize, which
                # Python cannot interrupt, while rank 0 still writes `save`
                world.barrier("the barrier after the run")
        except TrainingDiverged as exc:  # every rank leaves with 1 together
            if trainer.is_root:
                note(f"xpnn: {exc}: stopped, with nothing saved from it; try a smaller `lr`")
            return 1
        except MemoryError as exc:  # a step's activations: under ulimit -v, or CuPy's OutOfMemory
            oom = failure.one_line(str(exc)) or type(exc).__name__
            why = f"a training step ran out of memory ({oom}); try a smaller batch"
            raise UserError(f"`batch_size` {trainer.cfg.batch_size}: {why}") from None
        return 0

    return failure.run_guarded(world, job)


def build_run(
    spec: RunSpec, world: Any, callbacks: Sequence[Any] = (), log: Say = None, given: Given = None
) -> Any:
    """A ``Trainer`` ready to ``run()`` ``spec`` (collective); a preset leaves ``given`` alone."""
    say = log or (lambda line: print(line, flush=True))
    agree_on_user_errors(world, lambda: same_spec(spec, world))  # every rank calls it first
    # --model gpt: nanoGPT's recipe where spec is silent; then checked, the defaults filled
    given_spec = spec
    spec, preset = agree_on_user_errors(world, lambda: resolve(spec, given))
    chosen = None
    if auto.wanted(spec):  # chosen once, by rank 0, for every rank
        pick = functools.partial(auto.resolve_auto, spec, world.size, world.local_size)
        mine = agree_on_user_errors(world, lambda: pick(node_cores()) if world.rank == 0 else None)
        chosen, line = world.allgather_obj(mine, "the sharing of what auto chose")[0]
        if world.rank == 0:
            say(f"xpnn: {line}")
        chosen_spec = dataclasses.replace(given_spec, **chosen)
        kept = settings.given_settings(given_spec, given) | set(chosen)  # no recipe refills them
        spec, preset = agree_on_user_errors(world, lambda: resolve(chosen_spec, kept))
    backend, data, model, cfg, plan = agree_on_user_errors(world, lambda: _setup(spec, world))
    cfg.facts.auto = chosen
    if preset:
        cfg.facts.preset = {k: list(v) if isinstance(v, tuple) else v for k, v in preset.items()}
    if world.size > 1:  # data_dir may differ between ranks, the data they read may not
        what = "the check that every rank has the same data"
        allgather = functools.partial(world.allgather_obj, what=what)
        agree_on_user_errors(world, lambda: check_same_data(data, spec.data_dir, allgather))
        counts = world.allgather_obj(cfg.facts.threads, "the gathering of thread counts")
        if len(set(counts)) > 1:  # other cores or `threads`: the metrics carry every rank's
            cfg.facts.threads_per_rank = counts
    # A separate phase: on GPU backends building the communicators talks to the other ranks.
    groups = agree_on_user_errors(world, lambda: plan.groups(world, backend))
    if plan.spread:  # split layers and pipeline stages talk within their replica
        model.attach(groups.model)
    if plan.pipelined and plan.tensor_parts > 1:  # 3-D: a stage's parts
        model.attach_split(agree_on_user_errors(world, lambda: plan.stage_comm(world, backend)))
    callbacks = [*callbacks, *agree_on_user_errors(world, lambda: observers(spec, world.rank))]
    stall.set_limits(spec.stall_warn, spec.stall_abort)  # for every wait of this process

    def trainer() -> Trainer:
        outputs = ("metrics", "save", "checkpoint_dir", "keep_checkpoints", "progress")
        own = run_callbacks(say, world.rank == 0, **{n: getattr(spec, n) for n in outputs})
        built = Trainer(model, data, backend, groups.world, cfg, say, groups, [*own, *callbacks])
        start(built, spec.checkpoint_dir, spec.resume)  # last: a resume loads into it
        built.cfg.plan = plan.resolved(groups.name, built.update.name)
        built.cfg.facts.plan = built.cfg.plan.record()  # every metrics line says it
        return built

    # A third: /dev/shm full for mpi-shm, a checkpoint that does not fit the network: said once.
    return agree_on_user_errors(world, trainer)


def same_spec(spec: RunSpec, world: Any) -> None:
    """Ranks given other choices (an MPMD line) would train different runs, or hang."""
    if world.size == 1:
        return
    mine = {k: getattr(spec, k) for k in sorted(settings.DEFAULTS) if k not in settings.PER_RANK}
    mine["model"] = model_name(spec.model)  # a model object is compared by its name
    everyone = world.allgather_obj(mine, "the check that every rank has the same settings")
    for rank, theirs in enumerate(everyone):
        for key in mine:
            if theirs[key] != everyone[0][key]:
                said = f"rank {rank} was given {theirs[key]}, rank 0 {everyone[0][key]}"
                raise UserError(f"`{key}`: {said}; every rank must get the same settings")


def global_batch(spec: RunSpec, replicas: int, n_train: int) -> int:
    """The batch all replicas together take a step on."""
    if spec.per_rank_batch is not None:
        if spec.batch_size is not None:
            why = "give one (the global batch, or the batch of each replica)"
            raise UserError(f"`batch_size` and `per_rank_batch`: {why}")
        return spec.per_rank_batch * replicas
    if spec.batch_size is None:
        return BATCH
    if spec.batch_size == "full":
        return n_train
    try:
        value = int(spec.batch_size)
    except ValueError:
        said = f"expected a number or 'full', got {spec.batch_size!r}"
        raise UserError(f"`batch_size`: {said}") from None
    if value < 1:
        raise UserError(f"`batch_size`: must be at least 1, got {value}")
    return value


def resolve(spec: RunSpec, given: Given = None) -> tuple[RunSpec, dict]:
    """(``spec`` with a recipe where silent, checked, defaults filled; what the recipe filled)."""
    spec, preset = settings.gpt_preset(spec, given)
    settings.check_spec(spec)
    return settings.with_defaults(spec), preset


def train_config(spec: RunSpec, replicas: int = 1, n_train: int = 0) -> TrainConfig:
    """The trainer's settings from ``spec``, checked and its defaults filled."""
    settings.check_spec(spec)
    return _train_config(settings.with_defaults(spec), replicas, n_train)


def _train_config(spec: RunSpec, replicas: int, n_train: int, facts: Any = None) -> TrainConfig:
    """The hyper-parameters ``optimizer`` does not take are left out (a note says so)."""
    batch = global_batch(spec, replicas, n_train)
    if spec.accumulate > batch:
        said = f"more micro-steps than the global batch's {batch} samples"
        raise UserError(f"`accumulate` {spec.accumulate}: {said}")
    taken = HYPER_PARAMETERS[spec.optimizer]
    spec = dataclasses.replace(spec, **{name: None for name in HYPERS if name not in taken})
    lr = spec.lr * (replicas if spec.lr_scaling == "linear" else 1)
    return TrainConfig(spec, batch, lr, facts=facts or RunFacts())


def _setup(spec: RunSpec, world: Any) -> tuple:
    """Everything rank-local the user's input can fail: no communication, agreed on after."""
    threads = threads_per_rank(world.local_size, override=spec.threads, share=world.cores)
    plan = Plan.build(spec, world, threads)
    # batch threads: each its own BLAS and Numba threads, a share of the rank's
    apply_threads(max(1, threads // spec.batch_threads))
    backend = get_backend(spec.backend, spec.dtype, device_id=world.local_rank, device=spec.device)
    if spec.precision != "fp32" and backend.name == "numba":  # its kernels are fp32/fp64 only
        backend = get_backend("numpy", spec.dtype)
    size = spec.synthetic_size
    sets = dict(seed=spec.seed, block=spec.block, replicate=spec.replicate, synthetic_size=size)
    try:
        data = load_dataset(spec.dataset, spec.data_dir, **sets)
    except MemoryError as exc:  # replicate=100000000: NumPy says how much it wanted
        what = [f"`synthetic_size` {size}"] if spec.dataset == "synthetic" else []
        what += [f"`replicate` {spec.replicate}"] if spec.replicate > 1 else []
        what = " with ".join(what) or f"`dataset` {spec.dataset}"
        raise UserError(f"{what}: the data set does not fit in memory ({exc})") from None
    check_text_model(spec, data)
    name, shape, classes = model_name(spec.model), data.input_shape, data.num_classes
    gpt = {n: getattr(spec, n) for n in GPT_DEFAULTS}
    model = build_model(spec.model, spec.hidden, spec.activation, classes, spec.loss, shape, gpt)
    params = preset_parameters(spec.model, shape, classes, spec.hidden, gpt)  # too large: refused
    item, states = np.dtype(spec.dtype).itemsize, len(OPTIMIZERS[spec.optimizer].state_names)
    sizes = f"`hidden` {','.join(map(str, spec.hidden))}" if spec.model == "mlp" else None
    check_network_fits(sizes or "`model`", params, item, states)  # before it is built
    try:
        model = plan.apply(model, shape, backend, spec.seed, world.rank, spec.model)
    except MemoryError as exc:  # hidden=(99999999999,): NumPy says how much it wanted
        what = sizes or f"`model` {name}"  # the MLP by its sizes
        raise UserError(f"{what}: the network does not fit in memory ({exc})") from None
    except (ValueError, TypeError, IndexError) as exc:  # a user's model that does not fit
        if spec.model in MODELS:
            raise
        raise UserError(f"`model` {name}: {type(exc).__name__}: {exc}") from exc
    check_model(model, name, built=True)
    if not isinstance(model, LayeredModel) and (spec.batch_threads > 1 or spec.precision != "fp32"):
        what = f"`model` {name}: `batch_threads` and `precision`"
        raise UserError(f"{what} run the layers of an xpnn.nn.Sequential; this model has none")
    if isinstance(model, LayeredModel) and portion(model).scores:  # it holds the output
        check_fits(model, name, tuple(data.y_test.shape[1:]), classes)
    check_batch_threads(spec.batch_threads, threads, backend.name)
    plan = plan.settled(model)  # a pipeline's micro-batches, as its stage settled them
    said = {n: getattr(spec, n) for n in ("dataset", "dtype", "precision", "loss", "grad_dtype")}
    said |= {"parallel": spec.parallel, "model": name, "model_ranks": plan.model_ranks}
    said["batch_threads"] = spec.batch_threads if spec.batch_threads > 1 else None
    said["activation"] = spec.activation if spec.model == "mlp" else None
    said["thread_handoff"] = dict(HANDOFF_IN_FORCE) or None
    if plan.pipelined:  # as the stage settled them
        said |= {"microbatches": plan.microbatches, "pipeline_schedule": plan.schedule}
        said |= {"recompute": plan.recompute, "tensor_ranks": plan.tensor_parts}
    if spec.model == "gpt":  # what its checkpoint must say to be sampled from and resumed
        said |= {**gpt, "vocab": data.vocab.chars}
    facts = RunFacts(said, threads=threads, replicas=plan.replicas)  # each a share of a batch
    cfg = _train_config(spec, plan.replicas, data.n_train, facts)
    cfg.plan = plan
    facts.global_batch = cfg.batch_size
    return backend, data, model, cfg, plan


def check_text_model(spec: RunSpec, data: Any) -> None:
    """A GPT reads text; the image models read images."""
    is_text = data.vocab is not None
    if spec.model == "gpt" and not is_text:
        text = "a text data set (`dataset` tinyshakespeare or text)"
        raise UserError(f"`model` gpt: needs {text}, not {spec.dataset}")
    if spec.model != "gpt" and is_text:
        raise UserError(f"`dataset` {spec.dataset}: a text data set trains `model` gpt")
    if spec.model == "gpt" and spec.embed % spec.heads:
        why = "(each head takes an equal share of the embedding)"
        raise UserError(f"`heads` {spec.heads}: does not divide `embed` {spec.embed} {why}")
    if spec.model == "gpt" and spec.loss != "softmax_cross_entropy":
        raise UserError("`loss`: `model` gpt trains with softmax_cross_entropy at every position")


def summary(trainer: Any, asked: str, world: Any) -> list[str]:
    """What rank 0 says before training; ``asked``: the backend as given (``auto`` is said)."""
    groups, cfg, data, model = trainer.groups, trainer.cfg, trainer.data, trainer.model
    ranks = describe_ranks(trainer.comm.size, world.node_sizes if world.size > 1 else (1,))
    note = f" ({groups.fallback_reason})" if groups.fallback_reason else ""
    chosen = trainer.backend.describe()
    if asked == "auto":  # "numba (cpu, float32)" -> "numba (auto, cpu, float32)"
        chosen = chosen.replace(" (", " (auto, ", 1)
    line = model.summary()
    if is_spread(model):  # tensor and pipeline parallel: rank 0 holds a part
        line += f" on rank 0 of {whole_size(model):,}, {cfg.plan.mode} parallel"
        if groups.data.size > 1:
            line += f" over {groups.model.size} ranks x {groups.data.size} replicas"
    preset = ", ".join(f"`{n}` {settings.said(v)}" for n, v in (cfg.facts.preset or {}).items())
    said = [f"the gpt recipe for the settings not given: {preset}"] if preset else []
    setup = (
        f"{data.name} {data.n_train} train / {data.x_test.shape[0]} test, global batch "
        f"{cfg.batch_size}, {cfg.optimizer} lr {cfg.lr:g}, backend {chosen}, "
        f"comm {groups.name}{note}, {ranks} x {describe_threads(cfg.facts.record())}"
    )
    return [*said, line, setup, cfg.plan.header()]


def notes(spec: RunSpec, trainer: Any, world: Any) -> list[str]:
    """Worth a word, not an error: a fallback transport, settings ignored or probably a slip."""
    groups, cfg, n_train = trainer.groups, trainer.cfg, trainer.data.n_train
    notes = [f"comm {groups.name}: {groups.auto_fallback}"] if groups.auto_fallback else []
    notes += ineffective_settings(spec, groups, trainer.cfg.plan)
    if spec.precision != "fp32" and spec.backend == "numba" and trainer.backend.name == "numpy":
        notes.append(f"`precision` {spec.precision}: NumPy's kernels run it (Numba's: fp32, fp64)")
    # a pipeline cuts a batch into at most one micro-batch per sample: more are never run
    rows = -(-min(cfg.batch_size, n_train or cfg.batch_size) // spec.accumulate)  # a micro-step's
    replicas, pipelined, micro = cfg.facts.replicas or 1, cfg.plan.pipelined, spec.microbatches
    rows = -(-rows // replicas)  # the largest share of a batch a replica gets
    whose = "each replica's share of a batch" if replicas > 1 else "a batch"
    whose += "'s micro-step (`accumulate`)" if spec.accumulate > 1 else ""
    runs = "each micro-step runs" if spec.accumulate > 1 else "a step runs"
    batch = "per_rank_batch" if spec.per_rank_batch is not None else "batch_size"
    threads, share = cfg.facts.threads, world.cores or node_cores()
    env = ", ".join(f"{var}={value}" for var, value in REPLACED_ENV.items())
    slower = "take turns, which is slower"
    said = {
        f"`microbatches` {micro} is more than the {rows} sample(s) of {whose}: {runs} at most "
        f"{rows} micro-batch(es), of one sample each": pipelined and (micro or 0) > rows,
        "`recompute` has no effect with one micro-batch a step: its activations are still held "
        "when its backward pass comes, so none are computed again": (
            pipelined and spec.recompute and min(micro or settings.MICROBATCHES, rows) == 1
        ),
        f"`{batch}` makes a global batch of {cfg.batch_size}, more than the {n_train} training "
        "samples: every step takes the whole set (full-batch)": (
            cfg.batch_size > n_train and spec.batch_size != "full"
        ),
        f"`warmup_epochs` {spec.warmup_epochs:g} is longer than the run (`epochs` {spec.epochs}): "
        "the rate never reaches `lr`": spec.warmup_epochs > spec.epochs,
        f"{world.local_size} ranks on this node share fewer cores than there are ranks (or a CPU "
        f"quota worth fewer): they {slower}": world.crowded,
        f"`threads` {threads} but this rank has {share} core(s) of its own: the threads {slower}": (
            not world.crowded and threads > share
        ),
        # exported for all programs, or for this one?
        f"{env} in the environment: xpnn uses {threads} thread(s) per rank (its cores); give "
        "`threads` to choose": bool(REPLACED_ENV) and spec.threads is None,
    }
    return notes + [note for note, wanted in said.items() if wanted]


def ineffective_settings(spec: RunSpec, groups: Any, plan: Any) -> list[str]:
    """Settings given that this run ignores, and why: said, not silently dropped."""
    given = settings.given_settings(spec)
    found: list[str] = []

    def unused(names: Collection[str], ignored: bool, why: str) -> None:
        found.extend(f"`{name}` has no effect {why}" for name in names if name in given and ignored)

    model, data = f"with `model` {model_name(spec.model)}", groups.data
    synthetic = spec.dataset == "synthetic"
    unused(["keep_checkpoints"], not spec.checkpoint_dir, "without `checkpoint_dir`")
    unused(["data_dir"], synthetic, "with `dataset` synthetic: its samples are generated")
    unused(["synthetic_size"], not synthetic, f"with `dataset` {spec.dataset}")
    if spec.comm not in ("auto", "self") and groups.world.size == 1:
        found.append(f"`comm` {spec.comm} has no effect on 1 rank: there is nothing to exchange")
    unused(["hidden", "activation"], spec.model != "mlp", model)
    unused(["layers", "heads", "embed", "block"], spec.model != "gpt", model)
    pipeline = ["microbatches", "pipeline_schedule", "recompute", "tensor_ranks"]
    unused(pipeline, not plan.pipelined, "without `parallel` pipeline")
    taken = HYPER_PARAMETERS[spec.optimizer]
    unused([n for n in HYPERS if n not in taken], True, f"with `optimizer` {spec.optimizer}")
    unused(["min_lr"], spec.schedule != "cosine", f"with `schedule` {spec.schedule}")
    each_epoch = "without `steps`: each epoch ends with an evaluation"
    unused(["eval_every"], spec.steps is None, each_epoch)
    unused(["step_epochs"], spec.schedule != "step", f"with `schedule` {spec.schedule}")
    alone = "with one data-parallel rank: there is nothing to shard"
    unused(["shard_optimizer"], plan.replicas == 1, alone)
    unused(["model_ranks"], not plan.spread, "with `parallel` data: every rank holds the network")
    where, byte_buckets = f"with comm {data.name} on {data.size} rank(s)", uses_byte_buckets(data)
    if data.size == 1 and plan.spread:
        unused(["bucket_mb"], True, f"with `parallel` {plan.mode}: no gradients are exchanged")
    else:
        unused(["bucket_mb"], not byte_buckets, f"{where}: the update's buckets are cut at layers")
    unshared = data.size == 1 or byte_buckets
    unused(["node_share"], unshared, f"{where}: only mpi-shm shares a node's memory")
    sent = plan.spread or sends_gradients(data)
    shared = "one rank alone, or a node's ranks that share memory"
    unused(["grad_dtype"], not sent, f"{where}: no gradients are sent ({shared})")
    return found
