"""Peak memory of each pipeline stage, and the time of each schedule, under a real ``mpiexec``.

What: for each configuration in {GPipe, 1F1B} x {activations stashed, ``--recompute``} the script
runs ``mpiexec -n STAGES python -m xpnn --parallel pipeline --pipeline-schedule S [--recompute]
--metrics FILE --no-progress --threads 1`` and reads back from the metrics file the peak resident
memory of every rank (``peak_rss_mb`` of the ``done`` record; rank s is stage s) and the time of
the last epoch (``seconds`` of the last ``epoch`` record: the first epoch includes Numba
compilation, hence ``--epochs 2`` by default).

Why: memory is what pipelines are for. A pipeline cuts a network too big for one device into
stages, and what a stage must hold is its parameters *plus the activations of every micro-batch
in flight*: all M of them under GPipe, at most S - s under 1F1B, and under ``--recompute`` only
each micro-batch's stage input (its forward runs again before its backward, one more forward per
micro-batch). The table shows how much each schedule and ``--recompute`` save on each stage, and
what they cost in time per epoch; the summary lines give the saving of ``--recompute`` on the
heaviest stage, the one that decides how big a device the pipeline needs.

Every configuration is run ``--repeats`` times, configurations alternating (A B C D, D C B A,
...), and the table reports medians (and the min-max over repeats when there are several).

Caveat: peak RSS is each process's high-water mark of resident memory. It includes the Python
interpreter, NumPy, Numba and its compiled kernels, MPI's buffers and the data set (every rank
loads it), so only the *differences* between configurations are the pipeline's; compare
configurations, not absolute values.

Run: ``python bench/pipeline_memory.py`` (CNN, 2 stages, 16 micro-batches; about half a
minute on 2 cores), or ``python bench/pipeline_memory.py --help``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import (
    RESULTS_DIR,
    DefaultsFormatter,
    ForeignLoad,
    Parser,
    add_mpiexec_flag,
    busy_warning,
    can_plot,
    data_dir_problem,
    fmt_num,
    format_table,
    load_avg,
    machine_info,
    median,
    nonempty_path,
    nonneg_int,
    out_path,
    pipeline_problem,
    positive_int,
    pyplot_agg,
    refuse_unwritable,
    run_job,
    run_main,
    save_figure,
    timed_epochs,
    write_json,
)
from scaling import DEFAULT_DATA_DIR, hidden_sizes, mpiexec_path, refuse_without_mpiexec

NAME = "pipeline_memory"
CONFIGS: list[tuple[str, bool]] = [
    ("gpipe", False),
    ("gpipe", True),
    ("1f1b", False),
    ("1f1b", True),
]
"""(schedule, recompute) of every configuration, in the order of the first repeat."""
NOISY_CORES = 0.25  # other processes used more cores than this during a run: say so


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="bench/pipeline_memory.py",
        description="Peak memory per pipeline stage and time per epoch of GPipe and 1F1B, "
        "with and without --recompute, under mpiexec.",
        formatter_class=DefaultsFormatter,
    )
    a = p.add_argument
    a("--model", choices=("mlp", "cnn"), default="cnn")
    a("--hidden", type=hidden_sizes, default="1024,1024", help="MLP hidden sizes (--model mlp)")
    a("--stages", type=positive_int, default=2, help="pipeline stages = MPI ranks (at least 2)")
    a("--microbatches", type=positive_int, default=16, help="micro-batches per global batch")
    a("--batch-size", type=positive_int, default=512, help="GLOBAL batch")
    a("--dataset", choices=("synthetic", "fashion-mnist"), default="synthetic")
    a("--synthetic-size", type=positive_int, default=1024, help="synthetic train samples")
    a(
        "--data-dir",
        type=nonempty_path,
        default=str(DEFAULT_DATA_DIR) if DEFAULT_DATA_DIR.is_dir() else None,
        help="IDX directory (fashion-mnist)",
    )
    a("--epochs", type=timed_epochs, default=2, help="epochs per run; the last one is timed")
    a("--repeats", type=positive_int, default=2, help="runs per configuration (alternated)")
    a("--backend", choices=("numpy", "numba"), default="numba")
    a("--seed", type=nonneg_int, default=0, help="xpnn --seed")
    add_mpiexec_flag(a)
    a("--timeout", type=positive_int, default=900, help="seconds allowed per run")
    a("--out", type=out_path, default=RESULTS_DIR, help="output directory")
    return p


# --------------------------------------------------------------------------- runs


def label(schedule: str, recompute: bool) -> str:
    return f"{schedule}{' + recompute' if recompute else ''}"


def command(
    args: argparse.Namespace, mpiexec: str, schedule: str, recompute: bool, metrics: Path
) -> list[str]:
    cmd = [
        mpiexec, "-n", str(args.stages), sys.executable, "-m", "xpnn",
        "--parallel", "pipeline", "--pipeline-schedule", schedule,
        "--microbatches", str(args.microbatches), "--model", args.model,
        "--backend", args.backend, "--dataset", args.dataset,
        "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
        "--seed", str(args.seed), "--metrics", str(metrics), "--no-progress", "--threads", "1",
    ]  # fmt: skip
    if args.model == "mlp":
        cmd += ["--hidden", args.hidden]
    if args.dataset == "synthetic":
        cmd += ["--synthetic-size", str(args.synthetic_size)]
    elif args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    if recompute:
        cmd += ["--recompute"]
    return cmd


def run_once(
    args: argparse.Namespace, mpiexec: str, schedule: str, recompute: bool, metrics: Path
) -> dict[str, Any]:
    """One run: the per-rank peak RSS and the last epoch's seconds, as the metrics file says."""
    cmd = command(args, mpiexec, schedule, recompute, metrics)
    t0 = time.perf_counter()
    with ForeignLoad() as fl:
        run_job(cmd, args.timeout)
    wall = time.perf_counter() - t0
    records = [json.loads(s) for s in metrics.read_text().splitlines() if s.strip()]
    epochs = [r for r in records if r.get("event") == "epoch"]
    done = [r for r in records if r.get("event") == "done"]
    if not epochs or not done:
        raise RuntimeError(f"{metrics}: no epoch or no done record after {' '.join(cmd)}")
    peak = done[-1].get("peak_rss_mb")
    if not isinstance(peak, list) or len(peak) != args.stages:
        raise RuntimeError(f"{metrics}: peak_rss_mb {peak!r} is not one value per stage")
    got = (done[-1].get("pipeline_schedule"), done[-1].get("recompute"))
    if got != (schedule, recompute):  # the numbers must belong to the configuration named
        raise RuntimeError(f"{metrics}: asked for {(schedule, recompute)}, the run says {got}")
    return {
        "schedule": done[-1]["pipeline_schedule"],
        "recompute": done[-1]["recompute"],
        "microbatches": done[-1].get("microbatches"),
        "peak_rss_mb": peak,
        "last_epoch_s": round(float(epochs[-1]["seconds"]), 4),
        "epoch_seconds": [round(float(r["seconds"]), 4) for r in epochs],
        "wall_s": round(wall, 3),
        "foreign_cores": fl.cores,
        "comm": done[-1].get("comm"),
        "command": cmd,
    }


# --------------------------------------------------------------------------- report


def med(values: Sequence[float | None], digits: int) -> float | None:
    kept = [v for v in values if v is not None]
    return round(median(kept), digits) if kept else None


def span(values: Sequence[float | None]) -> list[float] | None:
    kept = [v for v in values if v is not None]
    return [min(kept), max(kept)] if kept else None


def summarise(args: argparse.Namespace, runs: dict[tuple[str, bool], list[dict]]) -> list[dict]:
    out = []
    for schedule, recompute in CONFIGS:
        results = runs[(schedule, recompute)]
        per_stage = [[r["peak_rss_mb"][s] for r in results] for s in range(args.stages)]
        times = [r["last_epoch_s"] for r in results]
        stage_mib = [med(v, 2) for v in per_stage]
        out.append(
            {
                "config": label(schedule, recompute),
                "schedule": schedule,
                "recompute": recompute,
                "stage_mib": stage_mib,
                "stage_mib_range": [span(v) for v in per_stage],
                "heaviest_stage": max(
                    range(args.stages), key=lambda s: -1.0 if stage_mib[s] is None else stage_mib[s]
                ),
                "last_epoch_s": med(times, 4),
                "last_epoch_s_range": span(times),
                "foreign_cores": [r["foreign_cores"] for r in results],
            }
        )
    return out


def savings(summary: list[dict]) -> list[dict[str, Any]]:
    """Per schedule: the heaviest stage's peak with --recompute over that without."""
    by = {(e["schedule"], e["recompute"]): e for e in summary}
    out = []
    for schedule in dict.fromkeys(s for s, _ in CONFIGS):
        base, rec = by[(schedule, False)], by[(schedule, True)]
        hb, hr = base["heaviest_stage"], rec["heaviest_stage"]
        mb, mr = base["stage_mib"][hb], rec["stage_mib"][hr]
        tb, tr = base["last_epoch_s"], rec["last_epoch_s"]
        out.append(
            {
                "schedule": schedule,
                "stashed_stage": hb,
                "stashed_mib": mb,
                "recompute_stage": hr,
                "recompute_mib": mr,
                "memory_ratio": None if not mb or mr is None else round(mr / mb, 4),
                "saved_mib": None if mb is None or mr is None else round(mb - mr, 1),
                "time_ratio": None if not tb or tr is None else round(tr / tb, 4),
            }
        )
    return out


def cell(value: float | None, rng: list[float] | None, repeats: int) -> str:
    if repeats < 2 or rng is None:
        return fmt_num(value)
    return f"{fmt_num(value)} ({fmt_num(rng[0])}-{fmt_num(rng[1])})"


def print_report(args: argparse.Namespace, summary: list[dict], saved: list[dict]) -> None:
    rng = " (min-max)" if args.repeats > 1 else ""
    headers = [
        "schedule",
        "recompute",
        *(f"stage {s} MiB{rng}" for s in range(args.stages)),
        f"last-epoch s{rng}",
    ]
    rows = [
        [
            e["schedule"],
            "yes" if e["recompute"] else "no",
            *(
                cell(e["stage_mib"][s], e["stage_mib_range"][s], args.repeats)
                for s in range(args.stages)
            ),
            cell(e["last_epoch_s"], e["last_epoch_s_range"], args.repeats),
        ]
        for e in summary
    ]
    print(f"\nPeak RSS per stage (median of {args.repeats} run(s)) and time of the last epoch")
    print(format_table(headers, rows))
    print()
    for s in saved:
        if s["memory_ratio"] is None:
            print(f"{s['schedule']}: --recompute saving not measured (no peak RSS reported)")
            continue
        time_part = "" if s["time_ratio"] is None else f"; last epoch {s['time_ratio']:.2f}x time"
        print(
            f"{s['schedule']}: --recompute heaviest stage {s['stashed_mib']:.1f} MiB "
            f"(stage {s['stashed_stage']}) -> {s['recompute_mib']:.1f} MiB "
            f"(stage {s['recompute_stage']}): {s['memory_ratio']:.2f}x the memory, "
            + (
                f"saves {s['saved_mib']:.1f} MiB"
                if s["saved_mib"] >= 0
                else f"takes {-s['saved_mib']:.1f} MiB more"
            )
            + time_part
        )


def plot(summary: list[dict], stages: int, path: Path, title: str) -> None:
    plt = pyplot_agg()
    fig, (ax_m, ax_t) = plt.subplots(
        1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [max(2, stages), 1.4]}
    )
    n = len(summary)
    width = 0.8 / n
    for i, e in enumerate(summary):
        xs = [s - 0.4 + width * (i + 0.5) for s in range(stages)]
        heights = [0.0 if v is None else v for v in e["stage_mib"]]
        err = [
            [h - (r[0] if r else h) for h, r in zip(heights, e["stage_mib_range"], strict=True)],
            [(r[1] if r else h) - h for h, r in zip(heights, e["stage_mib_range"], strict=True)],
        ]
        bars = ax_m.bar(xs, heights, width, yerr=err, capsize=3, label=e["config"])
        ax_m.bar_label(bars, fmt="%.0f", fontsize=7)
        t = e["last_epoch_s"] or 0.0
        r = e["last_epoch_s_range"] or [t, t]
        ax_t.bar([i], [t], 0.7, yerr=[[t - r[0]], [r[1] - t]], capsize=3, color=bars[0].get_fc())
    ax_m.set_xticks(range(stages))
    ax_m.set_xticklabels([f"stage {s}" for s in range(stages)])
    ax_m.set_ylabel("peak RSS (MiB)")
    ax_m.set_title("peak memory per stage", fontsize=9)
    ax_m.legend(fontsize=8)
    ax_t.set_xticks(range(n))
    ax_t.set_xticklabels([e["config"].replace(" + ", "\n+ ") for e in summary], fontsize=8)
    ax_t.set_ylabel("last epoch (s)")
    ax_t.set_title("time of the last epoch", fontsize=9)
    for ax in (ax_m, ax_t):
        ax.grid(axis="y", alpha=0.3)
    save_figure(fig, path, title)


# --------------------------------------------------------------------------- main


def model_name(args: argparse.Namespace) -> str:
    return f"MLP 784-{args.hidden.replace(',', '-')}-10" if args.model == "mlp" else "CNN"


def run(args: argparse.Namespace) -> int:
    mpiexec = mpiexec_path(args.mpiexec)
    warn = busy_warning()
    if warn:
        print(warn, flush=True)
    data = f"synthetic {args.synthetic_size}" if args.dataset == "synthetic" else args.dataset
    print(
        f"{NAME}: {model_name(args)}, {args.stages} stages x 1 thread, {args.microbatches} "
        f"micro-batches of a global batch {args.batch_size}, {args.backend}, {data}, "
        f"{args.epochs} epochs/run (the last one timed), {args.repeats} repeats of "
        f"{len(CONFIGS)} configurations",
        flush=True,
    )
    runs: dict[tuple[str, bool], list[dict]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="xpnn-pipeline-memory-") as tmp:
        for r in range(args.repeats):
            for schedule, recompute in CONFIGS if r % 2 == 0 else CONFIGS[::-1]:
                metrics = Path(tmp) / f"m_{schedule}_{int(recompute)}_{r}.jsonl"
                try:
                    res = run_once(args, mpiexec, schedule, recompute, metrics)
                except RuntimeError as exc:
                    print(f"{NAME}: {exc}", file=sys.stderr)
                    return 1
                res["repeat"] = r
                runs[(schedule, recompute)].append(res)
                noisy = (res["foreign_cores"] or 0.0) > NOISY_CORES
                print(
                    f"  repeat {r + 1}/{args.repeats}  {label(schedule, recompute):<17} "
                    f"peak MiB {res['peak_rss_mb']}  last epoch {res['last_epoch_s']:.3f} s"
                    f"  (others used {res['foreign_cores']} cores"
                    f"{': timing inflated' if noisy else ''})",
                    flush=True,
                )
    summary = summarise(args, runs)
    saved = savings(summary)
    print_report(args, summary, saved)
    json_path = args.out / f"{NAME}.json"
    plot_path = args.out / f"{NAME}.png"
    title = (
        f"xpnn {model_name(args)}, pipeline {args.stages} stages, {args.microbatches} "
        f"micro-batches, batch {args.batch_size}, {args.backend}, {data}, "
        f"{os.cpu_count()} CPUs"
    )
    if args.draw_plot:
        plot(summary, args.stages, plot_path, title)
    write_json(
        json_path,
        {
            "benchmark": NAME,
            "machine": machine_info(),
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "load_avg_end": load_avg(),
            "summary": summary,
            "recompute_savings": saved,
            "runs": [
                {"schedule": s, "recompute": rc, "results": runs[(s, rc)]} for s, rc in CONFIGS
            ],
        },
    )
    print(f"\nwrote {json_path}" + (f"\nwrote {plot_path}" if args.draw_plot else ""))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.stages < 2:
        parser.error(f"--stages {args.stages}: a pipeline needs at least 2 stages")
    hidden = [int(h) for h in args.hidden.split(",")]
    problem = pipeline_problem(args.model, hidden, args.stages)  # xpnn's rule, before any run
    if problem:
        parser.error(f"--stages {args.stages}: {problem}")
    if args.dataset != "synthetic":
        if not args.data_dir:
            parser.error(f"--data-dir: where are the {args.dataset} IDX files? (none by default)")
        problem = data_dir_problem(args.dataset, args.data_dir)
        if problem:
            parser.error(problem)
    refuse_unwritable(parser, "--out", args.out, folder=True)
    refuse_without_mpiexec(parser, args.mpiexec)
    args.draw_plot = can_plot(parser, asked=False)
    return run(args)


if __name__ == "__main__":
    run_main(main)
