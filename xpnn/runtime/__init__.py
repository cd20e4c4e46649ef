"""The process: its place in the job (``world``), threads per rank (``threads``), one failing
rank stopping all (``failure``, ``stall``), the last operations of each rank (``flight``),
what MPICH leaves behind (``segments``)."""

from xpnn.runtime import flight
from xpnn.runtime.failure import (
    CollectiveExit,
    agree_on_user_errors,
    run_guarded,
    stopped_from_outside,
)
from xpnn.runtime.memory import peak_rss_mb
from xpnn.runtime.stall import wait as wait_polled
from xpnn.runtime.threads import apply_threads, node_cores, threads_per_rank
from xpnn.runtime.world import World, init_world, launch_rank, library_name

__all__ = ["CollectiveExit", "World", "agree_on_user_errors", "apply_threads", "init_world"]
__all__ += ["launch_rank", "library_name", "node_cores", "run_guarded", "stopped_from_outside"]
__all__ += ["flight", "peak_rss_mb", "threads_per_rank", "wait_polled"]
