"""This process's peak resident memory, and whether a network can fit at all."""

import contextlib
import math
import sys

from xpnn.errors import UserError


def peak_rss_mb() -> float | None:
    """Peak resident memory in MiB (or None): VmHWM, as ``ru_maxrss`` survives fork and exec."""
    with contextlib.suppress(OSError), open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)  # kB
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (2**20 if sys.platform == "darwin" else 2**10), 1)  # bytes / KiB


def preset_parameters(
    model: object, input_shape: tuple[int, ...], classes: int, hidden: tuple[int, ...],
    gpt_sizes: dict[str, int],
) -> int | None:  # fmt: skip
    """A preset network's parameters before it is built (``gpt``: its blocks' 12 x embed**2)."""
    if model == "mlp":
        widths = [math.prod(input_shape), *hidden, classes]
        return sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))
    if model == "gpt":
        embed, block, layers = (gpt_sizes[k] for k in ("embed", "block", "layers"))
        return embed * (2 * classes + block) + layers * 12 * embed * embed
    return None


def check_network_fits(what: str, params: int | None, itemsize: int, states: int) -> None:
    """Refuse a network beyond memory and swap now: allocated lazily it meets the OOM killer."""
    from xpnn.data.files import memory_bytes

    have = memory_bytes()
    if params is None or have is None:
        return
    need = params * itemsize * (2 + states)
    if need > have:
        raise UserError(
            f"{what}: the network does not fit in memory: its {params:,} parameters need "
            f"{need / 2**30:,.1f} GiB with their gradients and the optimizer's state, more than "
            f"this machine's {have / 2**30:,.1f} GiB of memory and swap"
        )
