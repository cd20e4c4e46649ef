"""The critical batch size and the regimes come from a fit, and the fit recovers them: from
steps-to-target curves made with a known ``B_crit`` and noise, and from gradients with a
known noise scale."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from bench import critical_batch as cb
from bench.benchmarks import batch_regimes as br

BATCHES = [4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048]


def curve(b_crit: float, noise: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [1000 * (1 + b_crit / b) * math.exp(rng.gauss(0, noise)) for b in BATCHES]


@pytest.mark.parametrize("b_crit", [16.0, 64.0, 300.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fit_recovers_b_crit_and_every_regime_away_from_a_boundary(b_crit, seed):
    got = cb.analyse(BATCHES, curve(b_crit, 0.05, seed))
    assert got["b_crit"] == pytest.approx(b_crit, rel=0.3)
    low, high = cb.bounds(b_crit)
    for row in got["regimes"]:
        b = row["batch"]
        if b < low / 1.5:
            assert row["regime"] == "perfect scaling", row
        elif low * 1.5 < b < high / 1.5:
            assert row["regime"] == "diminishing returns", row
        elif b > high * 1.5:
            assert row["regime"] == "maximal data parallelism", row


def test_the_interval_holds_the_true_b_crit_about_as_often_as_it_says():
    covered = 0
    for seed in range(60):
        lo, hi = cb.interval(BATCHES, curve(64.0, 0.1, seed))
        covered += lo <= 64.0 <= hi
    assert 0.75 * 60 <= covered <= 0.99 * 60, covered  # a 90 % interval


def test_an_exact_curve_is_fitted_exactly():
    steps = [500 * (1 + 40 / b) for b in BATCHES]
    s_min, b_crit = cb.fit(BATCHES, steps)
    assert s_min == pytest.approx(500, rel=1e-9) and b_crit == pytest.approx(40, rel=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_the_regimes_never_flip_back_as_the_batch_grows(seed):
    """Noisy neighbours (the ratio rule named 16/32/64/128/256 maximal, diminishing,
    diminishing, maximal) cannot reorder the regimes read off the fit."""
    order = {name: i for i, name in enumerate(cb.REGIMES)}
    got = cb.analyse(BATCHES, curve(64, 0.25, seed))
    ranks = [order[r["regime"]] for r in got["regimes"]]
    assert ranks == sorted(ranks), got["regimes"]


def test_flat_and_perfect_curves_are_the_two_ends():
    assert cb.fit(BATCHES, [100.0] * len(BATCHES))[1] == 0.0
    assert {cb.regime(b, 0.0) for b in BATCHES} == {"maximal data parallelism"}
    assert math.isinf(cb.fit(BATCHES, [1e5 / b for b in BATCHES])[1])
    assert {cb.regime(b, math.inf) for b in BATCHES} == {"perfect scaling"}


def test_the_noise_scale_of_gradients_with_a_known_covariance():
    """Per-sample gradients G + N(0, σ² I) in d dimensions: tr(Σ) / |G|² = d σ² / |G|²."""
    rng = np.random.default_rng(0)
    d, sigma, g = 40, 0.5, np.full(40, 0.05)
    true = d * sigma**2 / float(g @ g)

    def sq_norm(batch: int) -> float:
        mean = g + rng.standard_normal((batch, d)).mean(axis=0) * sigma
        return float(mean @ mean)

    est = cb.noise_scale(8, 128, [sq_norm(8) for _ in range(2000)],
                         [sq_norm(128) for _ in range(2000)])  # fmt: skip
    assert est["b_simple"] == pytest.approx(true, rel=0.15)


def _record(batch: int, lr: float, steps: list[float]) -> dict:
    m = {"median": sorted(steps)[len(steps) // 2], "min": min(steps), "max": max(steps),
         "samples": steps}  # fmt: skip
    cmd = f"python -m bench batch_regimes --batches {batch} --lrs {lr} --target 0.9 --hidden 8"
    return {"config": {"batch": batch, "lr": lr, "command": cmd}, "metrics": {"steps": m},
            "machine": {}, "repeats": len(steps)}  # fmt: skip


def test_the_table_and_the_example_command_use_the_rates_that_won():
    recs = []
    for b, s in zip(BATCHES[:6], curve(32, 0.0, 0)[:6], strict=True):
        recs += [_record(b, 0.1, [s, s * 1.01]), _record(b, 0.3, [s * 2, s * 2.1])]
    assert "--lrs 0.1 " in br.example_command(recs)
    text = br.table(recs)
    assert "B_crit = 32" in text and "| 0.3 |" not in text
