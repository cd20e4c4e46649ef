"""Steps to a target test accuracy against the global batch (seed 004, Shallue et al. 2018).

For each batch size the learning rate is tuned from a small grid (the fewest steps wins).
Each run trains in this process through the library (``RunSpec``, ``build_run``) with a
callback that scores the test set at steps about 10 % apart and ends the run at the first
score at or above the target; the step is interpolated between that score and the one
before. (An epoch's evaluation would know a small batch's step only to within an epoch.)
Doubling the batch halves the steps in the perfect-scaling regime, helps less in the
diminishing-returns regime and not at all in the regime of maximal data parallelism. The
regimes and the critical batch size are read off a fit of the best steps against the batch
(``bench.critical_batch``); the gradient noise scale measured along one run predicts the
critical batch size from the gradients alone.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from bench import critical_batch as cb
from bench.core import fmt, markdown_table, record, spread
from bench.flags import float_list, fraction, int_list, positive_int
from bench.training import add_data_arguments, train_samples
from xpnn.train import Callback

NAME = "batch_regimes"
SUMMARY = "steps to a target accuracy vs global batch, lr tuned per size (seed 004)"
QUICK = {"samples": 512, "batches": [8, 16, 32, 64, 128, 256], "lrs": [0.1, 0.3]}
QUICK |= {"max_steps": 300, "target": 0.9}
NOISE_DRAWS = 4  # batches of each size drawn at every score of the noise-scale run
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
    p.add_argument(
        "--no-noise-scale",
        dest="noise_scale",
        action="store_false",
        help="skip the gradient noise scale (a run of the smallest batch that reached the target)",
    )


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


def _spec(args: argparse.Namespace, batch: int, lr: float, max_steps: int, seed: int) -> Any:
    from xpnn.run import RunSpec

    per_epoch = math.ceil(train_samples(args) / batch)
    return RunSpec(
        backend=args.backend, hidden=tuple(args.hidden), optimizer="sgd", lr=lr,
        batch_size=batch, epochs=math.ceil(max_steps / per_epoch), dataset=args.dataset,
        data_dir=args.data_dir, threads=args.threads, progress=False, seed=seed,
        synthetic_size=args.samples if args.dataset == "synthetic" else None,
    )  # fmt: skip


def _train(spec: Any, world: Any, watch: TargetWatch) -> float:
    """Train until ``watch`` stops the run; the seconds it took."""
    from xpnn.run import build_run
    from xpnn.train import TrainingDiverged

    t0 = time.perf_counter()
    try:
        build_run(spec, world, callbacks=[watch], log=lambda line: None).run()
    except (_Stop, TrainingDiverged):
        pass
    return time.perf_counter() - t0


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    from xpnn.runtime import init_world

    world = init_world()
    target = args.target if args.target is not None else TARGETS[args.dataset]
    n = train_samples(args)
    width = ",".join(map(str, args.hidden))
    out = []
    for batch in args.batches:
        per_epoch = math.ceil(n / batch)
        max_steps = min(args.max_steps, args.max_epochs * per_epoch)
        for lr in args.lrs:
            samples: dict[str, list[float]] = {"seconds": [], "steps": []}
            curves = []
            for seed in range(args.repeats):  # each repeat another seed: init and order
                watch = TargetWatch(target, max_steps)
                samples["seconds"].append(
                    _train(_spec(args, batch, lr, max_steps, seed), world, watch)
                )
                hit = steps_to_target(watch.curve, target)
                if hit is not None:
                    samples["steps"].append(hit)
                curves.append(watch.curve)
            if len(samples["steps"]) < args.repeats:  # a seed that missed: not reached
                samples.pop("steps")
            config = {
                "batch": batch, "lr": lr, "target": target, "max_steps": max_steps,
                "steps_per_epoch": per_epoch, "hidden": width, "dataset": args.dataset,
                "backend": args.backend, "train_samples": n, "seeds": args.repeats,
                "command": _command(args, f"--batches {batch} --lrs {lr}", target),
            }  # fmt: skip
            out.append(record(NAME, config, samples, machine, {"curve": curves[-1]}))
    if args.noise_scale:
        out += noise_record(args, world, out, machine, target)
    return out


def _command(args: argparse.Namespace, grid: str, target: float) -> str:
    data = f"--dataset {args.dataset} " + (
        f"--samples {args.samples}" if args.dataset == "synthetic"
        else f"--data-dir {args.data_dir}" if args.data_dir else ""
    )  # fmt: skip
    return (
        f"python -m bench batch_regimes {data.strip()} {grid} --target {target} "
        f"--hidden {','.join(map(str, args.hidden))} --backend {args.backend} "
        f"--threads {args.threads} --max-steps {args.max_steps} --max-epochs {args.max_epochs} "
        f"--repeats {args.repeats}"
    )


class NoiseWatch(TargetWatch):
    """A ``TargetWatch`` that, at each score, also draws batches of ``small`` and ``big``
    samples and keeps the squared norms of their mean gradients (the parameters as trained
    so far; the gradient buffer is refilled by the next step)."""

    def __init__(self, target: float, max_steps: int, small: int, big: int) -> None:
        super().__init__(target, max_steps)
        self.small, self.big = small, big
        self.norms: dict[int, list[float]] = {small: [], big: []}
        self._rng = None

    def on_step_end(self, trainer: Any, step: int) -> None:
        if step + 1 >= self._next or step + 1 >= self.max_steps:
            self._measure(trainer)
        super().on_step_end(trainer, step)

    def _measure(self, trainer: Any) -> None:
        import numpy as np

        from xpnn.nn import Context

        if self._rng is None:
            self._rng = np.random.default_rng(0)
        xp, model, data, backend = trainer.xp, trainer.model, trainer.data, trainer.backend
        rows = len(data.y_train)
        for size in (self.small, self.big):
            for _ in range(NOISE_DRAWS):
                pick = self._rng.choice(rows, size=min(size, rows), replace=False)
                x = backend.asarray(data.x_train[pick])
                y = backend.asarray(data.y_train[pick], dtype=xp.int64)
                model.loss_and_grads(x, y, Context(train=True), scale=1.0 / len(pick))
                self.norms[size].append(float(xp.sum(model.grads * model.grads)))


def noise_record(
    args: argparse.Namespace, world: Any, records: list[dict[str, Any]], machine: dict,
    target: float,
) -> list[dict[str, Any]]:  # fmt: skip
    """The gradient noise scale along the run of the smallest batch that reached the target
    (its best rate): one record, or none when no batch reached it."""
    reached = [p for p in best(records) if p[2] is not None]
    if not reached:
        return []
    batch, lr, _ = reached[0]
    small = batch
    big = min(train_samples(args), max(small * 8, max(args.batches)))
    if big <= small:
        return []
    per_epoch = math.ceil(train_samples(args) / batch)
    max_steps = min(args.max_steps, args.max_epochs * per_epoch)
    watch = NoiseWatch(target, max_steps, small, big)
    _train(_spec(args, batch, lr, max_steps, 0), world, watch)
    est = cb.noise_scale(small, big, watch.norms[small], watch.norms[big])
    config = {
        "measure": "gradient_noise", "batch": batch, "lr": lr, "small": small, "big": big,
        "draws": len(watch.norms[small]), "target": target,
        "command": _command(args, f"--batches {batch} --lrs {lr}", target),
    }  # fmt: skip
    samples = {"b_simple": [est["b_simple"]], "g2": [est["g2"]], "trace": [est["trace"]]}
    return [record(NAME, config, samples, machine, {"norms": watch.norms})]


Point = tuple[int, float | None, float | None]  # batch, best lr, steps (None: not reached)


def runs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The grid's records (not the noise-scale measurement)."""
    return [r for r in records if "measure" not in r["config"]]


def noise_of(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    got = [r for r in records if r["config"].get("measure") == "gradient_noise"]
    return got[-1] if got else None


def best(records: list[dict[str, Any]]) -> list[Point]:
    """Per batch size, the lr with the fewest steps; steps None where no lr reached the target."""
    out: list[Point] = []
    grid = runs(records)
    for batch in sorted({r["config"]["batch"] for r in grid}):
        hits = [
            (r["metrics"]["steps"]["median"], r["config"]["lr"])
            for r in grid
            if r["config"]["batch"] == batch and "steps" in r["metrics"]
        ]
        steps, lr = min(hits) if hits else (None, None)
        out.append((batch, lr, steps))
    return out


def fitted(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fit of the best steps against the batch (None: fewer than two batches reached)."""
    pts = [p for p in best(records) if p[2] is not None]
    if len(pts) < 2:
        return None
    return cb.analyse([p[0] for p in pts], [p[2] for p in pts])


def best_record(records: list[dict[str, Any]], batch: int, lr: float) -> dict[str, Any]:
    return next(
        r for r in runs(records) if r["config"]["batch"] == batch and r["config"]["lr"] == lr
    )


def fit_text(records: list[dict[str, Any]]) -> str:
    """The fit's numbers and the noise scale's, in a sentence a table caption can hold."""
    f = fitted(records)
    if f is None:
        return "Fewer than two batch sizes reached the target: no fit."
    lo, hi = f["b_crit_interval"]
    b1, b2 = cb.bounds(f["b_crit"])
    text = (
        f"Fit S = S_min (1 + B_crit / B) (McCandlish et al. 2018) to the best steps: "
        f"S_min = {fmt(f['s_min'])}, B_crit = {fmt(f['b_crit'])} (90 % bootstrap interval "
        f"{fmt(lo)}–{fmt(hi)}); perfect scaling below B ≈ {fmt(b1)}, maximal data parallelism "
        f"above B ≈ {fmt(b2)}. A regime marked ? changes within the interval."
    )
    noise = noise_of(records)
    if noise is not None:
        c = noise["config"]
        text += (
            f" Gradient noise scale B_simple = tr(Σ) / |G|² = "
            f"{fmt(noise['metrics']['b_simple']['median'])}, from mean gradients over "
            f"{c['small']} and {c['big']} samples ({c['draws']} draws each, along the run of "
            f"batch {c['batch']}): the critical batch size the gradients predict, beside the "
            f"measured B_crit {fmt(f['b_crit'])}."
        )
    return text


def example_command(records: list[dict[str, Any]]) -> str:
    """A command repeating this study with the rates that won."""
    pts = [p for p in best(records) if p[2] is not None]
    grid = runs(records)
    if not grid:
        return ""
    last = grid[-1]["config"]["command"]
    if not pts:
        return last
    batches = ",".join(str(p[0]) for p in pts)
    lrs = ",".join(str(x) for x in sorted({p[1] for p in pts}))
    head, _, tail = last.partition(" --batches ")
    return f"{head} --batches {batches} --lrs {lrs} --target{tail.partition(' --target')[2]}"


def table(records: list[dict[str, Any]]) -> str:
    pts = best(records)
    f = fitted(records)
    regime = {r["batch"]: r for r in f["regimes"]} if f else {}
    rows = []
    for b, lr, steps in pts:
        if steps is None:
            rows.append([b, "–", "not reached", "–", "–"])
            continue
        g = regime.get(b)
        name = "–" if g is None else g["regime"] + ("" if g["sure"] else " ?")
        model = cb.steps_at(b, f["s_min"], f["b_crit"]) if f else None
        rows.append([b, lr, spread(best_record(records, b, lr), "steps"), model, name])
    heads = ["global batch", "best lr", "steps to target", "fitted steps", "regime (from the fit)"]
    return markdown_table(heads, rows) + "\n\n" + fit_text(records)


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    pts = [p for p in best(records) if p[2] is not None]
    ax.set_title("steps to target against batch, with the fitted regimes")
    if not pts:
        ax.text(0.5, 0.5, "no batch size reached the target", ha="center", transform=ax.transAxes)
        return
    f = fitted(records)
    xs = [p[0] for p in pts]
    lo_x, hi_x = min(xs) / 1.5, max(xs) * 1.5
    if f is not None:
        b1, b2 = cb.bounds(f["b_crit"])
        colours = ("C2", "C1", "C3")
        edges = [lo_x, min(max(b1, lo_x), hi_x), min(max(b2, lo_x), hi_x), hi_x]
        for i, name in enumerate(cb.REGIMES):
            if edges[i + 1] > edges[i]:
                ax.axvspan(edges[i], edges[i + 1], color=colours[i], alpha=0.15, lw=0,
                           label=f"regime: {name}")  # fmt: skip
        lo, hi = f["b_crit_interval"]
        if math.isfinite(f["b_crit"]) and f["b_crit"] > 0:
            ax.axvline(f["b_crit"], color="k", lw=0.8, label=f"B_crit {fmt(f['b_crit'])}")
            if math.isfinite(lo) and math.isfinite(hi):
                ax.axvspan(max(lo, lo_x), min(hi, hi_x), color="k", alpha=0.08, lw=0,
                           label=f"90 % interval {fmt(lo)}–{fmt(hi)}")  # fmt: skip
            grid = [lo_x * (hi_x / lo_x) ** (i / 60) for i in range(61)]
            ax.plot(grid, [cb.steps_at(b, f["s_min"], f["b_crit"]) for b in grid], "k--",
                    lw=0.8, label="fit S_min (1 + B_crit / B)")  # fmt: skip
    noise = noise_of(records)
    if noise is not None:
        bs = noise["metrics"]["b_simple"]["median"]
        if math.isfinite(bs) and bs > 0:
            ax.axvline(bs, color="C4", lw=1.2, ls=":", label=f"B_simple (gradients) {fmt(bs)}")
    ranges = [best_record(records, b, lr)["metrics"]["steps"] for b, lr, _ in pts]
    err = [[m["median"] - m["min"] for m in ranges], [m["max"] - m["median"] for m in ranges]]
    ax.errorbar(xs, [p[2] for p in pts], yerr=err, fmt="ko", ms=4, capsize=2,
                label="measured, best lr (median, min–max over seeds)")  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="global batch (samples)",
           ylabel="steps to target (optimizer steps)", xlim=(lo_x, hi_x))  # fmt: skip
    ax.legend(fontsize=7, loc="lower left")
