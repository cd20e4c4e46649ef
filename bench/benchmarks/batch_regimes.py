"""Steps to a target test accuracy against the global batch (seed 004, Shallue et al. 2018).

For each batch size the learning rate is tuned from a small grid (the fewest steps wins).
The step at which the target is first met is interpolated linearly between the epochs'
evaluations (the metrics file has one per epoch); met at the first evaluation, it is only
known to be at most one epoch's steps, shown as "≤" and left out of the regimes. Doubling
the batch halves the steps in the perfect-scaling regime, helps less in the
diminishing-returns regime and not at all in the regime of maximal data parallelism.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from bench.core import float_list, int_list, markdown_table, record
from bench.training import add_data_arguments, command, data_flags, measure, train_samples

NAME = "batch_regimes"
SUMMARY = "steps to a target accuracy vs global batch, lr tuned per size (seed 004)"
QUICK = {"samples": 512, "batches": [8, 16, 32, 64, 128, 256], "lrs": [0.1, 0.3]}
QUICK |= {"max_steps": 300, "target": 0.9}
PERFECT, NO_GAIN = 0.65, 0.9  # steps(2B) / steps(B) below, and above, which a regime is named


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_arguments(p, samples=1024)
    p.add_argument("--batches", type=int_list, default=[4, 8, 16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--lrs", type=float_list, default=[0.01, 0.03, 0.1, 0.3, 1.0])
    p.add_argument("--target", type=float, default=0.99, help="test accuracy to reach")
    p.add_argument("--max-steps", type=int, default=3000, help="steps budget per run")
    p.add_argument("--hidden", default="64")


def steps_to_target(
    curve: list[dict[str, Any]], per_epoch: int, target: float
) -> tuple[float, bool] | None:
    """(steps, whether only an upper bound) to the first evaluation at or above ``target``."""
    prev_steps, prev_acc = 0.0, None
    for e in curve:
        steps, acc = e["epoch"] * per_epoch, e["test_acc"]
        if acc is not None and acc >= target:
            if prev_acc is None:  # met at the first evaluation: somewhere in the first epoch
                return float(steps), True
            frac = (target - prev_acc) / (acc - prev_acc) if acc > prev_acc else 1.0
            return prev_steps + max(0.0, min(1.0, frac)) * (steps - prev_steps), False
        prev_steps, prev_acc = steps, acc if acc is not None else prev_acc
    return None


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    n = train_samples(args)
    out = []
    for batch in args.batches:
        per_epoch = math.ceil(n / batch)
        epochs = max(2, min(400, math.ceil(args.max_steps / per_epoch)))
        for lr in args.lrs:
            flags = [
                "--model", "mlp", "--hidden", args.hidden, "--optimizer", "sgd", "--lr", repr(lr),
                "--batch-size", str(batch), "--epochs", str(epochs), *data_flags(args),
            ]  # fmt: skip
            samples, info = measure(1, flags, args, launcher=False)
            hit = steps_to_target(info["curve"], per_epoch, args.target)
            if hit is not None:
                samples["steps"] = [hit[0]]
                info["upper_bound"] = hit[1]
            config = {
                "batch": batch, "lr": lr, "target": args.target, "epochs": epochs,
                "steps_per_epoch": per_epoch, "hidden": args.hidden, "dataset": args.dataset,
                "train_samples": n, "command": command(1, flags, args, launcher=False),
            }  # fmt: skip
            out.append(record(NAME, config, samples, machine, info))
    return out


Point = tuple[int, float | None, float | None, bool]  # batch, best lr, steps, upper bound


def best(records: list[dict[str, Any]]) -> list[Point]:
    """Per batch size, the lr with the fewest steps; steps None where no lr reached the target."""
    out: list[Point] = []
    for batch in sorted({r["config"]["batch"] for r in records}):
        hits = [
            (
                r["metrics"]["steps"]["median"],
                r["config"]["lr"],
                r["info"].get("upper_bound", False),
            )
            for r in records
            if r["config"]["batch"] == batch and "steps" in r["metrics"]
        ]
        steps, lr, bound = min(hits) if hits else (None, None, False)
        out.append((batch, lr, steps, bound))
    return out


def regimes(points: list[Point]) -> list[str]:
    """The regime of each step from one batch size to the next (by the ratio of steps)."""
    names = []
    for (b0, _, s0, u0), (b1, _, s1, u1) in zip(points, points[1:], strict=False):
        if s0 is None or s1 is None or u0 or u1:
            names.append("–")
            continue
        ratio = (s1 / s0) ** (1 / math.log2(b1 / b0))  # per doubling
        names.append(
            "perfect scaling" if ratio < PERFECT else "diminishing returns" if ratio < NO_GAIN
            else "maximal data parallelism"
        )  # fmt: skip
    return names


def table(records: list[dict[str, Any]]) -> str:
    pts = best(records)
    reg = ["–", *regimes(pts)]
    rows = []
    for (b, lr, steps, bound), g in zip(pts, reg, strict=True):
        cell = "not reached" if steps is None else f"≤ {steps:.0f}" if bound else steps
        rows.append([b, "–" if lr is None else lr, cell, g])
    heads = ["global batch", "best lr", "steps to target", "regime (from the smaller batch)"]
    return markdown_table(heads, rows)


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    pts = [p for p in best(records) if p[2] is not None]
    colours = {"perfect scaling": "C2", "diminishing returns": "C1"}
    colours["maximal data parallelism"] = "C3"
    for (b0, *_), (b1, *_), g in zip(pts, pts[1:], regimes(pts), strict=False):
        ax.axvspan(b0, b1, color=colours.get(g, "white"), alpha=0.2, lw=0)
    ax.plot([p[0] for p in pts], [p[2] for p in pts], "k-")
    known = [p for p in pts if not p[3]]
    ax.plot([p[0] for p in known], [p[2] for p in known], "ko", label="measured")
    bound = [p for p in pts if p[3]]
    ax.plot([p[0] for p in bound], [p[2] for p in bound], "kv", mfc="none", label="at most")
    if pts:
        b0, s0 = pts[0][0], pts[0][2]
        ax.plot([p[0] for p in pts], [s0 * b0 / p[0] for p in pts], "k:", lw=0.8, label="perfect")
    for g, c in colours.items():
        ax.fill_between([], [], color=c, alpha=0.2, label=g)
    ax.set(xscale="log", yscale="log", xlabel="global batch", ylabel="steps to target")
    ax.set_title("batch-size regimes")
    ax.legend(fontsize=7)
