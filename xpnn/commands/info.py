"""``python -m xpnn info``: what this machine offers: backends, devices, MPI, threads."""

import contextlib
import json
import platform
import sys


def xpnn_version() -> str:
    """The installed distribution's version, else (a clone on ``PYTHONPATH``) the package's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("xpnn")
    except PackageNotFoundError:
        from xpnn import __version__

        return __version__


def collect() -> dict:
    from xpnn.backends import availability
    from xpnn.runtime import cpu_quota
    from xpnn.runtime.failure import agree_to_start
    from xpnn.runtime.threads import HANDOFF_IN_FORCE, affinity, node_cores, threads_per_rank
    from xpnn.runtime.world import init_world

    world = init_world()
    agree_to_start(world, "info")  # an MPMD line's other ranks may be training: they must hear
    out: dict = {
        "xpnn": xpnn_version(),
        "python": platform.python_version(),
        "numpy": __import__("numpy").__version__,
        "backends": {k: ("available" if v is None else v) for k, v in availability().items()},
        "cores": node_cores(),
        "affinity_cores": len(affinity()),
        "cpu_quota": cpu_quota(),
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
    out["threads_per_rank"] = threads_per_rank(world.local_size, share=world.cores)
    out["thread_handoff"] = dict(HANDOFF_IN_FORCE)
    try:
        from xpnn.parallel.comm.cuda_aware import mpi_info

        out["mpi"] = mpi_info()
    except ImportError as exc:
        out["mpi"] = f"mpi4py not usable: {exc}"
    return out


def info_main(as_json: bool = False) -> int:
    """Every rank takes part (starting MPI is collective); rank 0 alone prints."""
    from xpnn.runtime.threads import describe_handoff
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
        print(f"thread hand-off: {describe_handoff(data['thread_handoff'])}")
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
