"""The critical batch size, from the steps a target took and from the gradients themselves.

Steps: McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training", eq. 2.11) relate
the steps ``S`` to reach a target at batch ``B`` to the fewest possible, ``S_min``, by
``S = S_min (1 + B_crit / B)``: linear in ``1 / B``, fitted here by least squares on relative
errors. The regimes of Shallue et al. 2018 are then read off the fitted curve, not off the
ratios of neighbouring measurements, so they are monotone in ``B`` by construction: the steps
saved by doubling ``B``, ``S(2B) / S(B) = (2B + B_crit) / (2B + 2 B_crit)``, rise from 1/2
to 1 as ``B`` grows.

Gradients: the simple noise scale ``B_simple = tr(Σ) / |G|²`` (their appendix A.1) from the
squared norms of mean gradients over batches of two sizes, ``E|G_B|² = |G|² + tr(Σ) / B``,
predicts ``B_crit``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

PERFECT, NO_GAIN = 0.65, 0.9  # S(2B) / S(B) below, and above, which a regime is named
REGIMES = ("perfect scaling", "diminishing returns", "maximal data parallelism")
BOOTSTRAP = 400  # resamples for the interval of B_crit


def fit(batches: Sequence[float], steps: Sequence[float]) -> tuple[float, float]:
    """(S_min, B_crit) of ``S = S_min (1 + B_crit / B)`` by least squares weighted by
    ``1 / S²`` (each point's relative error counts alike). ``B_crit`` is 0 when the steps do
    not fall with B, ``inf`` when they fall as fast as 1 / B or faster (S_min <= 0)."""
    if len(batches) < 2:
        raise ValueError("a fit needs two batch sizes at least")
    # S = a + c u with u = 1 / B; minimise sum ((S_i - a - c u_i) / S_i)^2
    w = [1.0 / s**2 for s in steps]
    u = [1.0 / b for b in batches]
    sw = sum(w)
    su = sum(wi * ui for wi, ui in zip(w, u, strict=True))
    suu = sum(wi * ui * ui for wi, ui in zip(w, u, strict=True))
    ss = sum(wi * si for wi, si in zip(w, steps, strict=True))
    sus = sum(wi * ui * si for wi, ui, si in zip(w, u, steps, strict=True))
    det = sw * suu - su * su
    if det <= 0:
        raise ValueError("a fit needs two different batch sizes")
    a = (suu * ss - su * sus) / det
    c = (sw * sus - su * ss) / det
    if c <= 0:  # no gain from a larger batch anywhere measured
        return sum(steps) / len(steps), 0.0
    if a <= 0:  # steps fall as 1 / B or faster: perfect scaling throughout
        return 0.0, math.inf
    return a, c / a


def steps_at(b: float, s_min: float, b_crit: float) -> float:
    """The fitted curve's steps at batch ``b``."""
    if math.isinf(b_crit):
        return math.inf
    return s_min * (1 + b_crit / b)


def doubling_ratio(b: float, b_crit: float) -> float:
    """S(2B) / S(B) on the fitted curve: 1/2 far below ``B_crit``, 1 far above it."""
    if math.isinf(b_crit):
        return 0.5
    return (2 * b + b_crit) / (2 * b + 2 * b_crit)


def regime(b: float, b_crit: float) -> str:
    """The regime at batch ``b``: non-decreasing in ``b`` for a given ``b_crit``."""
    r = doubling_ratio(b, b_crit)
    return REGIMES[0] if r < PERFECT else REGIMES[1] if r < NO_GAIN else REGIMES[2]


def bounds(b_crit: float) -> tuple[float, float]:
    """The batch sizes where the regimes change: perfect below the first, maximal above the
    second (solving ``doubling_ratio`` = PERFECT, NO_GAIN)."""
    low = b_crit * (2 * PERFECT - 1) / (2 - 2 * PERFECT)
    high = b_crit * (2 * NO_GAIN - 1) / (2 - 2 * NO_GAIN)
    return low, high


def interval(
    batches: Sequence[float], steps: Sequence[float], level: float = 0.9, seed: int = 0
) -> tuple[float, float]:
    """A ``level`` bootstrap interval of ``B_crit``: the fit redone on the fitted curve times
    its relative residuals drawn with replacement (scaled up by ``sqrt(n / (n - 2))`` for
    the two parameters fitted)."""
    s_min, b_crit = fit(batches, steps)
    n = len(batches)
    if n < 3 or s_min <= 0 or b_crit == 0:
        return (b_crit, b_crit) if n >= 3 else (math.nan, math.nan)
    model = [steps_at(b, s_min, b_crit) for b in batches]
    inflate = math.sqrt(n / (n - 2))
    resid = [math.log(s / m) * inflate for s, m in zip(steps, model, strict=True)]
    rng = random.Random(seed)
    got = sorted(
        fit(batches, [m * math.exp(rng.choice(resid)) for m in model])[1] for _ in range(BOOTSTRAP)
    )
    tail = (1 - level) / 2
    return got[int(tail * (len(got) - 1))], got[math.ceil((1 - tail) * (len(got) - 1))]


def analyse(batches: Sequence[float], steps: Sequence[float]) -> dict[str, Any]:
    """The fit, its interval and each batch's regime, with ``sure`` False where the interval
    of ``B_crit`` puts that batch in another regime too."""
    s_min, b_crit = fit(batches, steps)
    lo, hi = interval(batches, steps)
    rows = []
    for b in batches:
        named = regime(b, b_crit)
        alt = {regime(b, x) for x in (lo, hi) if not math.isnan(x)}
        rows.append({"batch": b, "regime": named, "sure": alt <= {named}})
    return {"s_min": s_min, "b_crit": b_crit, "b_crit_interval": (lo, hi), "regimes": rows}


def noise_scale(
    small: int, big: int, sq_norm_small: Sequence[float], sq_norm_big: Sequence[float]
) -> dict[str, float]:
    """``B_simple = tr(Σ) / |G|²`` from squared norms of mean gradients over batches of
    ``small`` and ``big`` samples (McCandlish et al. appendix A.1): unbiased estimates of
    ``|G|²`` and ``tr(Σ)``, each averaged over the draws before their ratio is taken."""
    gs, gb = sum(sq_norm_small) / len(sq_norm_small), sum(sq_norm_big) / len(sq_norm_big)
    g2 = (big * gb - small * gs) / (big - small)
    trace = (gs - gb) / (1 / small - 1 / big)
    return {"g2": g2, "trace": trace, "b_simple": trace / g2 if g2 > 0 else math.inf}
