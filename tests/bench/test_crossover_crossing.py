"""The crossover's crossing size and the sizes that bracket it, from repeats: synthetic CPU
and GPU times with a known crossing, and the titles of a run without a GPU."""

from __future__ import annotations

from bench.benchmarks import crossover
from bench.core import stats

SIZES = [16, 32, 64, 128, 256, 512, 1024]


def _records(cpu: dict[int, list[float]], gpu: dict[int, list[float]] | None) -> list[dict]:
    out = []
    for n in SIZES:
        metrics = {"cpu_ms": stats(cpu[n])}
        if gpu is not None:
            metrics["e2e_ms"] = stats(gpu[n])
        out.append({"config": {"m": n, "k": n, "n": n, "dtype": "float32",
                               "shape": f"{n}×{n} @ {n}×{n}"},
                    "metrics": metrics, "repeats": 3, "machine": {}})  # fmt: skip
    return out


def test_the_crossing_is_interpolated_and_bracketed_by_the_repeats():
    cpu = {n: [(n / 100) ** 3 * f for f in (0.95, 1.0, 1.05)] for n in SIZES}  # 1.0 at n = 100
    gpu = {n: [1.0 * f for f in (0.95, 1.0, 1.05)] for n in SIZES}
    x = crossover.crossing(_records(cpu, gpu), "float32", "e2e_ms")
    assert 64 < x["n"] < 128 and abs(x["n"] - 100) < 15, x
    assert x["low"] == 64 and x["high"] == 128, x  # the GPU lost at 64, won at 128, every time
    assert "≈" in crossover.crossing_text(x) and "between 64 and 128" in crossover.crossing_text(x)


def test_overlapping_repeats_widen_the_bracket():
    cpu = {n: [(n / 100) ** 3 * f for f in (0.5, 1.0, 2.0)] for n in SIZES}
    gpu = {n: [1.0 * f for f in (0.5, 1.0, 2.0)] for n in SIZES}
    x = crossover.crossing(_records(cpu, gpu), "float32", "e2e_ms")
    assert x["low"] < 64 or x["high"] > 128, x


def test_a_gpu_that_never_wins_and_a_run_without_one():
    cpu = {n: [0.001, 0.001, 0.001] for n in SIZES}
    gpu = {n: [1.0, 1.0, 1.0] for n in SIZES}
    assert crossover.crossing(_records(cpu, gpu), "float32", "e2e_ms")["n"] is None
    records = _records(cpu, None)
    assert crossover.crossing(records, "float32", "e2e_ms") is None
    assert "No GPU found" in crossover.table(records)
    from bench.plots import pyplot

    plt = pyplot()
    fig, ax = plt.subplots()
    crossover.plot(records, ax)
    assert ax.get_title().startswith("CPU matmul time against size (no GPU found)")
    assert "3 samples" in ax.get_title() and ax.get_ylabel() == "time per product (ms)"
    plt.close(fig)
