"""xpnn: neural networks written once against an ``xp`` array namespace."""

__version__ = "0.1.0"


def set_threads(n: int | None = None) -> dict:
    """Hold BLAS's, OpenMP's and Numba's threads to ``n`` (default: the cores), as ranks do."""
    from xpnn.backends import set_threads as limit

    return limit(n)
