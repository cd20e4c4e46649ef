"""Every record carries the conditions it was measured in, and a measurement that the load
or its own spread makes untrustworthy is marked noisy, with the reason, in its record, its
table and its figure."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from bench import core
from bench.plots import pyplot


def _spin() -> None:
    while True:
        pass


def test_a_benchmark_run_under_an_artificial_load_is_marked_noisy(tmp_path):
    """More spinning processes than cores while crossover runs: every record says so."""
    spinners = [multiprocessing.Process(target=_spin, daemon=True)
                for _ in range(core.usable_cores() + 2)]  # fmt: skip
    for p in spinners:
        p.start()
    try:
        out = tmp_path / "c.jsonl"
        proc = subprocess.run(
            [sys.executable, "-m", "bench", "crossover", "--sizes", "16,32", "--no-extra",
             "--dtypes", "float64", "--repeats", "3", "--sample-ms", "1", "--out", str(out)],
            capture_output=True, text=True, cwd=ROOT, timeout=300,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
    finally:
        for p in spinners:
            p.kill()
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    for r in records:
        assert any(w.startswith("busy machine") for w in r["noisy"]), r["noisy"]
        cond = r["conditions"]
        assert cond["load_before"]["runnable"] > core.usable_cores(), cond
        assert set(r["machine"]["versions"]) >= {"numpy", "threadpoolctl"}
        assert r["machine"]["blas"] and "cpu_quota" in r["machine"]
    assert "NOISY" in proc.stdout and "busy machine" in proc.stdout
    assert "†" in proc.stdout  # the table's cells


def _rec(samples: list[float], load: float = 0.1, runnable: int = 1) -> dict:
    r = {"machine": {"usable_cores": 2}, "metrics": {"epoch_s": core.stats(samples)},
         "config": {"ranks": 1},
         "conditions": {"load_before": {"load1": load, "runnable": runnable},
                        "load_after": {"load1": load, "runnable": runnable}}}  # fmt: skip
    return r


def test_a_wide_spread_is_noisy_and_a_tight_one_on_a_quiet_machine_is_not():
    assert core.noise(_rec([1.0, 1.1, 1.2])) == []
    (why,) = core.noise(_rec([1.0, 1.1, 1.4]))
    assert why.startswith("wide spread") and "epoch_s 1.40x" in why
    (why,) = core.noise(_rec([1.0, 1.1], load=3.5))
    assert why.startswith("busy machine") and "3.5" in why
    assert core.noise(_rec([1.0], runnable=4))  # 3 other threads on 2 cores
    # a 2-rank run leaves a load average of about 2 behind it: its own, not a competitor's
    two_ranks = _rec([1.0, 1.1], load=2.1)
    two_ranks["config"] = {"ranks": 2, "threads": 1}
    assert core.noise(two_ranks) == []
    two_ranks["conditions"]["load_after"]["load1"] = 4.5
    assert core.noise(two_ranks)[0].startswith("busy machine")
    acc = _rec([1.0])
    acc["metrics"]["test_acc"] = core.stats([0.1, 0.9])  # not a timing: no spread rule
    assert core.noise(acc) == []


def test_tables_show_the_range_and_the_repeats_and_mark_noise():
    assert core.spread(_rec([1.0, 1.1, 1.2]), "epoch_s") == "1.1 (1–1.2, n=3)"
    assert core.spread(_rec([2.0]), "epoch_s") == "2 (n=1)"
    assert core.spread(_rec([1.0, 2.0]), "epoch_s").endswith(" †")


def test_a_figure_says_quick_and_noisy(tmp_path):
    pyplot()
    r = _rec([1.0, 2.0])
    r["quick"] = True
    png = tmp_path / "f.png"
    figures = []
    import matplotlib.pyplot as plt

    close = plt.close
    plt.close = figures.append
    try:
        from bench.plots import draw

        draw(png, [lambda ax: ax.plot([1, 2], [1, 2])], "t", core.marks([r]))
    finally:
        plt.close = close
    (fig,) = figures
    texts = fig._suptitle.get_text() + fig.axes[0].get_title()
    assert "QUICK RUN" in texts and "NOISY" in texts and "wide spread" in texts
    close(fig)


@pytest.mark.parametrize(("speedups", "word"), [
    ([10.0, 10.0, 10.0, 3.0, 3.6, 7.0], "noise"),  # 1-rank 10 s, 2-rank 3-7 s: 1.4-3.3
    ([10.0, 10.1, 10.0, 3.0, 3.1, 3.05], "super-linear"),
])  # fmt: skip
def test_a_speedup_above_the_ranks_says_whether_the_spread_explains_it(speedups, word):
    one, two = _rec(speedups[:3]), _rec(speedups[3:])
    text = core.speedup(one, two, "epoch_s", 2)
    assert "‡" in text and word in text, text
    assert "‡" not in core.speedup(one, _rec([6.0, 6.1]), "epoch_s", 2)


def test_quiet_wait_says_when_the_load_did_not_fall(monkeypatch):
    from bench import quiet

    monkeypatch.setattr(core, "load_now", lambda: {"load1": 9.0, "runnable": 12})
    said = []
    got = quiet.wait_below_cores(0.3, said.append)
    assert got["quiet"] is False and got["waited_s"] >= 0.3 and got["load1"] == 9.0
    assert "measuring anyway" in said[0]
    monkeypatch.setattr(core, "load_now", lambda: {"load1": 0.2, "runnable": 1})
    assert quiet.wait_below_cores(5, said.append)["quiet"] is True


def test_the_sides_of_a_comparison_alternate_round_by_round(monkeypatch):
    from argparse import Namespace

    from bench import training

    order = []

    def fake_run(ranks, flags, args, launcher=True):
        order.append(ranks)
        return {"epoch_s": float(ranks), "train_s": 1.0, "epochs": [], "done": {}}

    monkeypatch.setattr(training, "timed_run", fake_run)
    got = training.measure_sides([(1, ["a"]), (2, ["b"]), (4, ["c"])], Namespace(repeats=3))
    assert order == [1, 2, 4, 4, 2, 1, 1, 2, 4]
    assert [s["epoch_s"] for s, _ in got] == [[1.0] * 3, [2.0] * 3, [4.0] * 3]


def test_report_check_refuses_a_quick_run_beside_published_numbers_unmarked(tmp_path):
    from bench.report import check

    png = b"\x89PNG\r\n\x1a\n" + b"0" * 8
    (tmp_path / "s.png").write_bytes(png)
    body = "| a |\n|---|\n| 1 |\n\n![s](s.png)\n"
    (tmp_path / "records.jsonl").write_text(
        json.dumps(
            {"schema": 1, "benchmark": "scaling", "quick": True, "config": {}, "metrics": {}}
        )
        + "\n"
    )
    (tmp_path / "index.md").write_text(f"# r\n\n## Seed 000: scaling\n\n{body}")
    assert any("QUICK RUN" in p for p in check(tmp_path))
    (tmp_path / "index.md").write_text(f"# r\n\n## Seed 000: scaling\n\nQUICK RUN\n\n{body}")
    assert check(tmp_path) == []
