"""``python -m xpnn [train|info|plot|trace|generate|bench]``: exit 0 on success; 2 a user error,
one line naming the flag or file, said once for all ranks; 1 anything else."""

import contextlib
import functools
import json
import platform
import sys
from collections.abc import Sequence
from typing import Any

from xpnn.backends import availability
from xpnn.commands import flags
from xpnn.commands.generate import main as generate_main
from xpnn.commands.plan import main as planner_main
from xpnn.errors import UserError, user_message, worded
from xpnn.parallel.comm.cuda_aware import mpi_info
from xpnn.record.plot import main as plot_main
from xpnn.record.timeline import main as trace_main
from xpnn.run import launch
from xpnn.runtime import failure, segments, threads
from xpnn.runtime.interrupts import hand_over, imported_mpi
from xpnn.runtime.world import LaunchMismatch, init_world, launch_rank, launched_by_mpi
from xpnn.train.callbacks import CheckpointOnSignal

__all__ = ["main"]


def _say(line: str, err: bool = False) -> None:
    try:
        print(flags.flag_words(line), file=sys.stderr if err else sys.stdout, flush=True)
    except BrokenPipeError:  # `| head`: stopped from outside, as failure words it
        raise
    except OSError as exc:  # a full disk under `> log`: say which stream failed
        raise _stream_failed(exc, "stderr" if err else "stdout") from None


def _stream_failed(exc: OSError, stream: str) -> OSError:
    if stream == "stdout":
        failure.silence_stdout()
    return OSError(exc.errno, f"cannot write to {stream}: {exc.strerror}")


def _start_up_failure(command: str, line: str) -> int:
    """A problem found before MPI runs, maybe on this rank alone: under a launcher it still
    starts MPI, so that the others hear of it rather than wait in ``MPI_Init``."""
    mpi = imported_mpi()
    joined = mpi is not None and mpi.Is_initialized()  # a check after MPI_Init failed
    try:
        under_launcher = launched_by_mpi() is not None
    except UserError:
        under_launcher = False
    if joined or not under_launcher:
        if launch_rank() == 0:  # every process found the same: one says it
            failure.say(f"xpnn: {line}")
        return 2
    try:
        world = init_world()
    except LaunchMismatch as exc:  # no MPI on any rank, and no launcher to ask: rank 0 says it
        if launch_rank() == 0:
            failure.say(f"xpnn: {failure.one_line(user_message(exc))}")
        return 2
    except UserError as exc:  # MPI does not start on this rank: ask the launcher to end it
        for said in dict.fromkeys((line, user_message(exc))):
            failure.say(f"rank {launch_rank()}: {failure.one_line(said)}")
        failure.abort_launch()
        return 2
    if world.size == 1:
        failure.say(f"xpnn: {line}")
        return 2
    return failure.run_guarded(world, lambda: failure.agree_to_start(world, command, line))


def xpnn_version() -> str:
    """The installed distribution's version, else (a clone on ``PYTHONPATH``) the package's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("xpnn")
    except PackageNotFoundError:
        from xpnn import __version__

        return __version__


def collect() -> dict:
    """``python -m xpnn info``: what this machine offers: backends, devices, MPI, threads."""
    world = init_world()
    # an MPMD line's other ranks may be training: they must hear
    failure.agree_to_start(world, "info")
    out: dict = {
        "xpnn": xpnn_version(),
        "python": platform.python_version(),
        "numpy": __import__("numpy").__version__,
        "backends": {k: ("available" if v is None else v) for k, v in availability().items()},
        "cores": threads.node_cores(),
        "affinity_cores": len(threads.affinity()),
        "cpu_quota": threads.cpu_quota(),
        "world": {n: getattr(world, n) for n in ("rank", "size", "local_size")},
    }
    out["world"]["node_sizes"] = list(world.node_sizes)
    with contextlib.suppress(ImportError):
        out["numba"] = __import__("numba").__version__
    if out["backends"]["cupy"] == "available":
        import cupy

        out["cupy"] = cupy.__version__
        out["devices"] = []
        for i in range(cupy.cuda.runtime.getDeviceCount()):
            name = cupy.cuda.runtime.getDeviceProperties(i)["name"]
            out["devices"].append(name.decode() if isinstance(name, bytes) else name)
    if out["backends"]["torch"] == "available":
        from xpnn.backends.torch_backend import visible_devices

        out["torch"] = __import__("torch").__version__
        out["torch_devices"] = visible_devices()
    out["threads_per_rank"] = threads.threads_per_rank(world.local_size, share=world.cores)
    out["thread_handoff"] = dict(threads.HANDOFF_IN_FORCE)
    try:
        out["mpi"] = mpi_info()
    except ImportError as exc:
        out["mpi"] = f"mpi4py not usable: {exc}"
    return out


def info_main(as_json: bool = False) -> int:
    """Every rank takes part (starting MPI is collective); rank 0 alone prints."""
    from xpnn.runtime.world import describe_ranks

    if (data := collect())["world"]["rank"] != 0:
        return 0
    if as_json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"xpnn {data['xpnn']}")
    print(f"python {data['python']}, numpy {data['numpy']}, numba {data.get('numba', '-')}")
    print("backends:")
    for name, status in data["backends"].items():
        print(f"  {name:6s} {status}")
    for i, dev in enumerate(data.get("devices", [])):
        print(f"  cuda:{i} {dev}")
    if "torch_devices" in data:
        print(f"torch {data['torch']} devices: {', '.join(data['torch_devices'])}")
    quota, seen = data["cpu_quota"], data["affinity_cores"]
    limited = "" if quota is None else f" (a CPU quota of {quota:g} on {seen} cores)"
    print(
        f"cores: {data['cores']}{limited}; threads per rank by default: {data['threads_per_rank']}"
    )
    if data["thread_handoff"]:
        print(f"thread hand-off: {threads.describe_handoff(data['thread_handoff'])}")
    if (world := data["world"])["size"] > 1:
        spread = describe_ranks(world["size"], tuple(world["node_sizes"]))
        spread = f"{spread}; " if len(world["node_sizes"]) > 1 else ""
        print(f"ranks: {world['size']} ({spread}{world['local_size']} on this node)")
    if isinstance(mpi := data["mpi"], dict):
        print(f"MPI: {mpi['library']} (MPI {mpi['mpi_version']}, mpi4py {mpi['mpi4py']})")
        print(f"  mpi_memory_alloc_kinds: {mpi['alloc_kinds'] or 'not reported (an MPI 4.1 key)'}")
        query = mpi["mpix_query_cuda_support"]
        print(f"  MPIX_Query_cuda_support(): {'not provided' if query is None else query}")
        print(f"  library built CUDA-aware: {'yes' if mpi['library_cuda_aware'] else 'no'}")
        print(f"  CUDA driver and device: {mpi['cuda_runtime']}")
        print(f"  CUDA-aware: {'yes' if mpi['cuda_aware'] else 'no'} ({mpi['cuda_aware_reason']})")
    else:
        print(f"MPI: {mpi}")
    if sys.stdout is not None:  # None: started with stdout closed (>&-); print did nothing
        sys.stdout.flush()
    return 0


def _info(as_json: bool) -> int:
    """``python -m xpnn info``; stdout gone or full is one line, as training says it."""
    try:
        return info_main(as_json=as_json)
    except failure.CollectiveExit as exc:  # the job's ranks do not all run info
        return int(exc.code or 0)
    except OSError as exc:
        if exc.filename is None and not isinstance(exc, BrokenPipeError):
            exc = _stream_failed(exc, "stdout")  # info writes nothing else
        message, code = failure.stopped_from_outside(exc) or (failure.describe(exc), 1)
        failure.say(f"xpnn: {message}")
        return code


def main(argv: list[str] | None = None, callbacks: Sequence[Any] = ()) -> int:
    """``python -m xpnn``; ``callbacks`` (``xpnn.train.Callback``) join the trainer's."""
    argv = list(sys.argv[1:] if argv is None else argv)
    tools = {"plot": plot_main, "generate": generate_main, "trace": trace_main}
    tools |= {n: functools.partial(planner_main, n) for n in ("plan", "explain", "calibrate")}
    if argv and argv[0] in tools:
        return tools[argv[0]](argv[1:])
    if argv and argv[0] == "bench":  # the benchmark suite, installed beside xpnn
        from bench.__main__ import main as bench_main

        return bench_main(argv[1:])
    if argv in (["--version"], ["train", "--version"]):
        print(f"xpnn {xpnn_version()}")
        return 0
    command = argv.pop(0) if argv and argv[0] in ("train", "info") else "train"
    segments.write_stdout_into_launchers_pipe()  # `mpiexec ... | head`: see the module
    parser = flags.build_info_parser() if command == "info" else flags.build_parser()
    try:
        args = parser.parse_args(argv)
        given = flags.typed_settings(parser, argv) if command == "train" else None
    except flags.ArgError as exc:
        return _start_up_failure(command, str(exc))
    except SystemExit as exc:  # -h: printed; an MPMD line's other ranks must hear of it
        if exc.code not in (0, None):
            raise
        return failure.help_given(command)
    with worded(flags.flag_words):  # every message printed from here names flags
        try:
            if command == "info":
                hand_over()  # no run_guarded: Ctrl-C is for the except below
                return _info(args.json)
            if args.checkpoint_signal:  # before MPI_Init: the signal's default action would end it
                on_signal = CheckpointOnSignal(args.checkpoint_signal, args.checkpoint_dir)
                callbacks = [on_signal, *callbacks]
            warn = functools.partial(_say, err=True)
            return launch(flags.to_spec(args), callbacks, log=_say, warn=warn, given=given)
        except UserError as exc:  # before MPI: maybe on this rank alone
            return _start_up_failure(command, user_message(exc))
        except KeyboardInterrupt as exc:  # while NumPy or MPI start, without xpnn.__main__
            message, code = failure.stopped_from_outside(exc) or ("interrupted", 130)
            if launch_rank() == 0:
                failure.say(f"xpnn: {message}")
            return code
