"""Figures a reader can trust, read from their artists: every figure of ``bench report`` (drawn
from the recorded report's own records), of the GPU recording's benchmarks and of ``xpnn plot``
has a legend where it draws several labelled things and names nothing it does not draw, integer
ticks on count axes, and time, speedup, memory and accuracy axes that start at 0."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.benchmarks import load  # noqa: E402
from bench.core import read_records  # noqa: E402
from bench.report import RECORDED_GPU, STUDIES, panels  # noqa: E402
from xpnn.record import plot as xpnn_plot  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECORDS = read_records(ROOT / "docs" / "report" / "records.jsonl")
COUNTS = ("ranks", "processes", "epoch")  # x labels that count things
FROM_ZERO = ("seconds", "speedup", "MB", "MiB", "accuracy", "loss", "samples")


def _figures() -> list[tuple[str, list]]:
    found = [(s, panels(s, [r for r in RECORDS if r["benchmark"] == s])) for s in STUDIES[:-1]]
    gpu = read_records(RECORDED_GPU)
    for name in ("crossover", "allreduce", "staging", "throughput", "step_phases"):
        rs = [r for r in gpu if r["benchmark"] == name]
        found.append((name, [lambda ax, rs=rs, name=name: load(name).plot(rs, ax)]))
    return found


def _labelled(ax) -> list[str]:
    artists = [*ax.get_lines(), *ax.patches, *ax.collections, *ax.containers]
    labels = [str(a.get_label() or "_") for a in artists]
    return [label for label in labels if not label.startswith("_")]


def check_axes(fig, what: str) -> None:
    groups: dict[tuple, list] = {}  # axes sharing a position: one panel and its twin
    for ax in fig.axes:
        groups.setdefault(tuple(ax.get_position().bounds), []).append(ax)
    for axes in groups.values():
        labels = [label for ax in axes for label in _labelled(ax)]
        legends = [ax.get_legend() for ax in axes if ax.get_legend() is not None]
        if len(labels) >= 2:
            assert legends, f"{what}: {labels} drawn without a legend"
        for legend in legends:
            named = [t.get_text() for t in legend.get_texts()]
            assert set(named) <= set(labels), f"{what}: legend names {named}, drawn {labels}"
            assert set(labels) <= set(named), f"{what}: {labels} drawn, legend names {named}"
        for ax in axes:
            if ax.get_xlabel() in COUNTS:
                lo, hi = ax.get_xlim()
                ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
                assert ticks and all(float(t).is_integer() for t in ticks), (what, ticks)
            label = ax.get_ylabel()
            if ax.get_yscale() == "linear" and any(w in label for w in FROM_ZERO):
                assert ax.get_ylim()[0] == 0, f"{what}: {label} starts at {ax.get_ylim()[0]}"
            if "accuracy %" in label:
                assert ax.get_ylim()[1] == 100, f"{what}: {label} ends at {ax.get_ylim()[1]}"


@pytest.mark.parametrize("name, drawn", _figures(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_report_figure_reads_right(name, drawn):
    fig, axes = plt.subplots(1, len(drawn), squeeze=False)
    for ax, panel in zip(axes[0], drawn, strict=True):
        panel(ax)
    fig.canvas.draw()
    try:
        check_axes(fig, name)
        assert not fig.texts, f"{name}: a figure title besides its panels' own"
    finally:
        plt.close(fig)


def test_the_gpu_allreduce_draws_a_line_per_transport():
    rs = read_records(RECORDED_GPU, "allreduce")
    fig, ax = plt.subplots()
    load("allreduce").plot(rs, ax)
    kinds = {(r["config"]["buffers"], r["config"]["comm"]) for r in rs}
    assert len(ax.get_lines()) == len(kinds)
    for line in ax.get_lines():  # sizes only grow along a line: no zigzag between transports
        xs = list(line.get_xdata())
        assert xs == sorted(set(xs))
    plt.close(fig)


def test_xpnn_plot_has_integer_epochs_and_readable_legends(tmp_path, monkeypatch):
    metrics = tmp_path / "run.jsonl"
    lines = [
        {"event": "epoch", "epoch": e, "train_loss": 1 / e, "test_loss": 1.1 / e,
         "train_acc": 0.101 + e / 1000, "test_acc": 0.1 + e / 1000, "samples_per_s": 900 + e,
         "world_size": 2, "backend": "numpy"}
        for e in (1, 2, 3)
    ]  # fmt: skip
    metrics.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read it
    xpnn_plot.draw([metrics], tmp_path / "run.png")
    (fig,) = figures
    fig.canvas.draw()
    check_axes(fig, "xpnn plot")
    for ax in fig.axes:
        assert ax.get_legend().get_texts()[0].get_fontsize() >= 9
    accuracy = next(ax for ax in fig.axes if ax.get_title() == "accuracy")
    assert accuracy.get_ylim() == (0, 1)


def test_the_report_is_redrawn_from_its_records(tmp_path):
    import shutil

    from bench.report import QUICK_CALIBRATION, check, redraw

    shutil.copy(ROOT / "docs" / "report" / "records.jsonl", tmp_path)
    shutil.copy(ROOT / "docs" / "report" / "index.md", tmp_path)
    index = redraw(tmp_path, str(QUICK_CALIBRATION))  # predicted without measuring
    assert check(tmp_path) == []
    text, recorded = index.read_text(), (ROOT / "docs" / "report" / "index.md").read_text()
    head = text.split("\n## ")[0].split("\nEach section repeats")[0]
    assert head == recorded.split("\n## ")[0].split("\nEach section repeats")[0]  # its header
    assert text.count("\n## Seed ") == recorded.count("\n## Seed ") == 4
    link = text.split("[Reproducing the reports](")[1].split(")")[0]
    assert (tmp_path / link).resolve() == (ROOT / "docs" / "reproducing.md").resolve(), link
    assert " and tensor and " not in text  # a list in prose, not joined by "and"s


def test_a_column_empty_in_every_row_is_left_out():
    from bench.core import markdown_table

    text = markdown_table(["n", "d2h_pinned ms", "e2e ms"], [[1, None, 2.0], [2, None, 3.0]])
    assert text.splitlines()[0] == "| n | e2e ms |" and "–" not in text
    kept = markdown_table(["n", "raw"], [[1, None], [2, 5.0]])
    assert kept.splitlines()[0] == "| n | raw |" and "| 1 | – |" in kept
