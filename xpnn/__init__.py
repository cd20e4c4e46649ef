"""xpnn: neural networks written once against an ``xp`` array namespace."""

__version__ = "0.1.0"


def set_threads(n: int | None = None) -> dict:
    """Hold BLAS's, OpenMP's and Numba's thread pools to ``n`` threads (default: this process's
    cores), as ``python -m xpnn`` does for each rank."""
    from xpnn.backends.threads import set_threads as limit

    return limit(n)
