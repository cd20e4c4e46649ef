"""xpnn: neural networks written once against an ``xp`` array namespace."""

__version__ = "0.1.0"


def set_threads(n: int | None = None) -> dict:
    """Hold BLAS's, OpenMP's and Numba's thread pools to ``n`` threads (default: the cores
    this process may run on), as ``python -m xpnn`` does for each rank; the first
    ``get_backend`` of a process does this unless a count was set or exported."""
    from xpnn.backends.threads import set_threads as limit

    return limit(n)
