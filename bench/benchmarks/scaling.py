"""Strong and weak scaling of data-parallel training (seed 000's study, its network by default).

Strong: the same data set on 1, 2, ... ranks, replicated to 60,000 samples unless
``--replicate`` says otherwise (the synthetic set's 5,000 samples 12 times; MNIST and
Fashion-MNIST once). Weak: the training set once per rank. The defaults are seed 000's run:
one sigmoid hidden layer, a sigmoid output with binary cross-entropy, full-batch gradient
descent, 10 iterations (epochs of one step).
"""

from __future__ import annotations

import argparse
from typing import Any

from bench.core import markdown_table, median_of, record, speedup, spread
from bench.flags import positive_float, positive_int, rank_list
from bench.plots import count_axis, legend
from bench.predicted import LABEL, predicted
from bench.training import add_data_arguments, command, data_flags, measure_sides, train_samples

NAME = "scaling"
SUMMARY = "strong and weak scaling of data-parallel training (seed 000)"
SEED000_SAMPLES = 60_000  # the report's strong-scaling set: MNIST's 5,000 replicated 12 times
QUICK = {"samples": 1000, "replicate": 6, "epochs": 3, "hidden": "64"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_data_arguments(p, samples=5000)
    p.add_argument("--ranks", type=rank_list, default=[1, 2], help="comma list of rank counts")
    p.add_argument("--modes", default="strong,weak", help="strong, weak or both")
    p.add_argument(
        "--replicate", type=positive_int, help="strong: copies of the data (default: to 60,000)"
    )
    p.add_argument("--hidden", default="256", help="hidden sizes")
    p.add_argument("--activation", default="sigmoid")
    p.add_argument("--loss", default="sigmoid_bce")
    p.add_argument("--optimizer", default="sgd")
    p.add_argument("--lr", type=positive_float, default=0.1)
    p.add_argument("--batch-size", default="full", help="global batch, or 'full'")
    p.add_argument(
        "--epochs", type=positive_int, default=10, help="epochs (iterations when full batch)"
    )


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    model = [
        "--model", "mlp", "--hidden", args.hidden, "--activation", args.activation,
        "--loss", args.loss, "--optimizer", args.optimizer, "--lr", f"{args.lr:g}",
        "--batch-size", args.batch_size, "--epochs", str(args.epochs),
    ]  # fmt: skip
    out = []
    for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
        if mode not in ("strong", "weak"):
            raise argparse.ArgumentTypeError(f"--modes: unknown {mode!r} (strong, weak)")
        sides = [
            (
                n,
                [
                    *model,
                    *data_flags(args),
                    "--replicate",
                    str(strong_copies(args) if mode == "strong" else n),
                ],
            )
            for n in args.ranks
        ]
        for (n, flags), (samples, info) in zip(sides, measure_sides(sides, args), strict=True):
            copies = strong_copies(args) if mode == "strong" else n
            config = {
                "mode": mode, "ranks": n, "threads": args.threads, "hidden": args.hidden,
                "activation": args.activation, "loss": args.loss, "optimizer": args.optimizer,
                "lr": args.lr, "batch_size": args.batch_size, "epochs": args.epochs,
                "dataset": args.dataset, "train_samples": train_samples(args) * copies,
                "command": command(n, flags, args),
            }  # fmt: skip
            out.append(record(NAME, config, samples, machine, info))
    return out


def strong_copies(args: argparse.Namespace) -> int:
    """Copies of the training set that make seed 000's 60,000 samples (or ``--replicate``)."""
    return args.replicate or max(1, round(SEED000_SAMPLES / train_samples(args)))


def rows(records: list[dict[str, Any]], mode: str) -> list[list[Any]]:
    """Speedup (strong) or efficiency against the 1-rank run of the same mode; then the
    planner's predicted training time and speedup (None where there is no prediction)."""
    rs = sorted(
        (r for r in records if r["config"]["mode"] == mode), key=lambda r: r["config"]["ranks"]
    )
    if not rs:
        return []
    base = median_of(rs[0], "train_s")
    n0 = rs[0]["config"]["ranks"]
    p0 = predicted(rs[0], "train_s")
    out = []
    for r in rs:
        n, t = r["config"]["ranks"], median_of(r, "train_s")
        gain = base / t if mode == "strong" else base / t * n / n0
        shown = speedup(rs[0], r, "train_s", n / n0) if mode == "strong" else gain
        p = predicted(r, "train_s")
        p_gain = None if p is None or p0 is None else p0 / p * (1 if mode == "strong" else n / n0)
        out.append([r["config"]["train_samples"], n, spread(r, "train_s"), gain,
                    gain * n0 / n, shown, p, p_gain])  # fmt: skip
    return out


def table(records: list[dict[str, Any]], mode: str | None = None) -> str:
    """One mode's table, or every mode's present under a heading each."""
    if mode is None:
        modes = [m for m in ("strong", "weak") if rows(records, m)]
        return "\n\n".join(f"{m} scaling:\n\n{table(records, m)}" for m in modes)
    head = "speedup (range)" if mode == "strong" else "scaled speedup"
    short = "speedup" if mode == "strong" else "scaled speedup"
    shown = [[*r[:3], r[5], r[4], r[6], r[7]] for r in rows(records, mode)]
    heads = ["samples", "ranks", "time s", head, "efficiency", "predicted s", f"predicted {short}"]
    return markdown_table(heads, shown)


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    """Speedup (strong) and scaled speedup (weak) against ranks, with the ideal line."""
    n: list[int] = []
    for mode in ("strong", "weak"):
        rs = rows(records, mode)
        if rs:
            n = [r[1] for r in rs]
            low, high = _bounds(records, mode)
            err = [[r[3] - lo for r, lo in zip(rs, low, strict=True)],
                   [hi - r[3] for r, hi in zip(rs, high, strict=True)]]  # fmt: skip
            ax.errorbar(n, [r[3] for r in rs], yerr=err, fmt="o-", capsize=3,
                        label=f"{mode} (median, bars: range of the repeats)")  # fmt: skip
            pts = [(r[1], r[7]) for r in rs if r[7] is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), "x--", label=f"{mode}: {LABEL}")
    if n:
        ax.plot(n, [x / n[0] for x in n], "r:", label="ideal")
        count_axis(ax, n)
    ax.set(xlabel="ranks", ylabel="speedup over the fewest ranks (×)", title="scaling")
    ax.set_ylim(bottom=0)
    legend(ax)


def _bounds(records: list[dict[str, Any]], mode: str) -> tuple[list[float], list[float]]:
    """The least and most speedup the repeats allow at each rank count (fastest over slowest
    either way), scaled by the ranks for weak scaling as ``rows`` is."""
    rs = sorted(
        (r for r in records if r["config"]["mode"] == mode), key=lambda r: r["config"]["ranks"]
    )
    b, n0 = rs[0]["metrics"]["train_s"], rs[0]["config"]["ranks"]
    low, high = [], []
    for r in rs:
        m, k = r["metrics"]["train_s"], (r["config"]["ranks"] / n0 if mode == "weak" else 1)
        low.append(b["min"] / m["max"] * k)
        high.append(b["max"] / m["min"] * k)
    return low, high
