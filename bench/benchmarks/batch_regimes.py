"""Steps to a target test accuracy against the global batch (seed 004, Shallue et al. 2018).

For each batch size the learning rate is tuned from a small grid (the fewest steps wins).
Each run trains in this process through the library (``RunSpec``, ``build_run``) with a
callback that scores the test set at steps about 10 % apart and ends the run at the first
score at or above the target; the step is interpolated between that score and the one
before. (An epoch's evaluation would know a small batch's step only to within an epoch.)
Doubling the batch halves the steps in the perfect-scaling regime, helps less in the
diminishing-returns regime and not at all in the regime of maximal data parallelism.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from bench.core import markdown_table, record
from bench.flags import float_list, fraction, int_list, positive_int
from bench.training import add_data_arguments, train_samples
from xpnn.train import Callback

NAME = "batch_regimes"
SUMMARY = "steps to a target accuracy vs global batch, lr tuned per size (seed 004)"
QUICK = {"samples": 512, "batches": [8, 16, 32, 64, 128, 256], "lrs": [0.1, 0.3]}
QUICK |= {"max_steps": 300, "target": 0.9}
PERFECT, NO_GAIN = 0.65, 0.9  # steps(2B) / steps(B) below, and above, which a regime is named
GROWTH = 1.1  # the next score comes after this many times the steps done so far
# No new best score since the steps were a quarter of what they are (and 200 steps at least):
# the target is out of reach for this learning rate (it diverged or stalled).
PATIENCE, PATIENCE_STEPS = 4, 200
TARGETS = {"synthetic": 0.99, "mnist": 0.97, "fashion-mnist": 0.83}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_arguments(p, samples=1024)
    p.add_argument("--batches", type=int_list, default=[4, 8, 16, 32, 64, 128, 256, 512, 1024])
    p.add_argument("--lrs", type=float_list, default=[0.01, 0.03, 0.1, 0.3, 1.0])
    p.add_argument(
        "--target", type=fraction, help="test accuracy to reach (default: " +
        ", ".join(f"{k} {v}" for k, v in TARGETS.items()) + ")",
    )  # fmt: skip
    p.add_argument("--max-steps", type=positive_int, default=60000, help="steps budget per run")
    p.add_argument("--max-epochs", type=positive_int, default=30, help="epochs budget per run")
    p.add_argument("--hidden", type=int_list, default=[64], help="hidden widths, e.g. 64,64")
    p.add_argument("--backend", default="numpy", choices=("numpy", "numba"))


class _Stop(Exception):
    """Ends a run from inside its training loop: target met or budget spent."""


class TargetWatch(Callback):
    """Scores the test set at steps about ``GROWTH`` apart; stops at the target, at the
    budget, or when the best score is ``PATIENCE`` times as old (a diverged or stalled run)."""

    def __init__(self, target: float, max_steps: int) -> None:
        self.target, self.max_steps = target, max_steps
        self.curve: list[tuple[int, float]] = []  # (steps done, test accuracy)
        self._next = 1
        self._best = (0, -1.0)  # (steps, accuracy) of the best score

    def on_step_end(self, trainer: Any, step: int) -> None:
        done = step + 1
        if done < self._next and done < self.max_steps:
            return
        acc = float(trainer.evaluate()[1])
        if acc > self._best[1]:
            self._best = (done, acc)
        self.curve.append((done, acc))
        self._next = max(done + 1, math.ceil(done * GROWTH))
        stalled = done >= max(PATIENCE_STEPS, PATIENCE * self._best[0])
        if acc >= self.target or done >= self.max_steps or stalled:
            raise _Stop


def steps_to_target(curve: list[tuple[int, float]], target: float) -> float | None:
    """The step at which the test accuracy crossed ``target``, interpolated linearly between
    the scores either side; None if it never did."""
    prev: tuple[int, float] | None = None
    for steps, acc in curve:
        if acc >= target:
            if prev is None:
                return float(steps)
            s0, a0 = prev
            frac = (target - a0) / (acc - a0) if acc > a0 else 1.0
            return s0 + max(0.0, min(1.0, frac)) * (steps - s0)
        prev = (steps, acc)
    return None


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    from xpnn.run import RunSpec, build_run
    from xpnn.runtime import init_world
    from xpnn.train import TrainingDiverged

    world = init_world()
    target = args.target if args.target is not None else TARGETS[args.dataset]
    n = train_samples(args)
    hidden = tuple(args.hidden)
    width = ",".join(map(str, hidden))
    out = []
    for batch in args.batches:
        per_epoch = math.ceil(n / batch)
        max_steps = min(args.max_steps, args.max_epochs * per_epoch)
        for lr in args.lrs:
            spec = RunSpec(
                backend=args.backend, hidden=hidden, optimizer="sgd", lr=lr, batch_size=batch,
                epochs=math.ceil(max_steps / per_epoch), dataset=args.dataset,
                data_dir=args.data_dir, threads=args.threads, progress=False,
                synthetic_size=args.samples if args.dataset == "synthetic" else None,
            )  # fmt: skip
            watch = TargetWatch(target, max_steps)
            t0 = time.perf_counter()
            try:
                build_run(spec, world, callbacks=[watch], log=lambda line: None).run()
            except (_Stop, TrainingDiverged):
                pass
            samples = {"seconds": [time.perf_counter() - t0]}
            hit = steps_to_target(watch.curve, target)
            if hit is not None:
                samples["steps"] = [hit]
            data = f"--dataset {args.dataset} " + (
                f"--samples {args.samples}" if args.dataset == "synthetic"
                else f"--data-dir {args.data_dir}" if args.data_dir else ""
            )  # fmt: skip
            config = {
                "batch": batch, "lr": lr, "target": target, "max_steps": max_steps,
                "steps_per_epoch": per_epoch, "hidden": width, "dataset": args.dataset,
                "backend": args.backend, "train_samples": n,
                "command": f"python -m bench batch_regimes {data.strip()} --batches {batch} "
                f"--lrs {lr} --target {target} --hidden {width} --backend {args.backend} "
                f"--threads {args.threads} --max-steps {args.max_steps} "
                f"--max-epochs {args.max_epochs}",
            }  # fmt: skip
            out.append(record(NAME, config, samples, machine, {"curve": watch.curve}))
    return out


Point = tuple[int, float | None, float | None]  # batch, best lr, steps (None: not reached)


def best(records: list[dict[str, Any]]) -> list[Point]:
    """Per batch size, the lr with the fewest steps; steps None where no lr reached the target."""
    out: list[Point] = []
    for batch in sorted({r["config"]["batch"] for r in records}):
        hits = [
            (r["metrics"]["steps"]["median"], r["config"]["lr"])
            for r in records
            if r["config"]["batch"] == batch and "steps" in r["metrics"]
        ]
        steps, lr = min(hits) if hits else (None, None)
        out.append((batch, lr, steps))
    return out


def regimes(points: list[Point]) -> list[str]:
    """The regime of each step from one batch size to the next (by the ratio of steps)."""
    names = []
    for (b0, _, s0), (b1, _, s1) in zip(points, points[1:], strict=False):
        if s0 is None or s1 is None:
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
    for (b, lr, steps), g in zip(pts, reg, strict=True):
        rows.append([b, "–" if lr is None else lr, "not reached" if steps is None else steps, g])
    heads = ["global batch", "best lr", "steps to target", "regime (from the smaller batch)"]
    return markdown_table(heads, rows)


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    pts = [p for p in best(records) if p[2] is not None]
    ax.set_title("batch-size regimes")
    if not pts:
        ax.text(0.5, 0.5, "no batch size reached the target", ha="center", transform=ax.transAxes)
        return
    colours = {"perfect scaling": "C2", "diminishing returns": "C1"}
    colours["maximal data parallelism"] = "C3"
    drawn: set[str] = set()  # the legend names only the regimes it shades
    for (b0, *_), (b1, *_), g in zip(pts, pts[1:], regimes(pts), strict=False):
        if g in colours:
            label = f"regime: {g}" if g not in drawn else None
            ax.axvspan(b0, b1, color=colours[g], alpha=0.2, lw=0, label=label)
            drawn.add(g)
    ax.plot([p[0] for p in pts], [p[2] for p in pts], "ko-", label="measured (best lr)")
    b0, s0 = pts[0][0], pts[0][2]
    ideal = [s0 * b0 / p[0] for p in pts]
    ax.plot([p[0] for p in pts], ideal, "k:", lw=0.8, label="half the steps per doubled batch")
    ax.set(xscale="log", yscale="log", xlabel="global batch", ylabel="steps to target")
    ax.legend(fontsize=8)
