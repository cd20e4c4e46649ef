"""The process: rank, threads, failures, stalls, Ctrl-C; lazy names, so interrupts imports first."""

import importlib

_MODULES = {
    "failure": "CollectiveExit agree_on_user_errors run_guarded stopped_from_outside",
    "stall": "wait_polled",
    "threads": "HANDOFF apply_threads cpu_quota node_cores peak_rss_mb set_handoff"
    " threads_per_rank",
    "world": "World init_world launch_rank library_name",
}
_WHERE = {name: module for module, names in _MODULES.items() for name in names.split()}
__all__ = [*_WHERE, "flight"]  # the module imports itself


def __getattr__(name: str) -> object:
    if name not in _WHERE:
        raise AttributeError(f"module 'xpnn.runtime' has no attribute {name!r}")
    module = importlib.import_module(f"xpnn.runtime.{_WHERE[name]}")
    return getattr(module, "wait" if name == "wait_polled" else name)
