"""Strong and weak scaling of ``python -m xpnn`` under a real ``mpiexec -n N``.

Strong scaling: a fixed training set (60,000 samples by default) and a fixed *global* batch
(``--batch-size``), N = 1, 2, ... ranks, each with ``--threads-per-rank`` threads; the
speedup is T(1) / T(N) and the parallel efficiency speedup / (cores used). Weak scaling: the
data per rank is fixed (Fashion-MNIST repeated N times with ``--replicate N``, or a synthetic
set of N x ``--synthetic-size`` samples) and so is the batch per rank (``--per-rank-batch``);
the efficiency is T(1) / T(N). ``--compare-threads`` adds the row "1 rank x (max N x
threads-per-rank) threads", the same cores used by threads instead of processes.

Each run trains ``--epochs`` epochs and the script reads the per-epoch ``seconds`` from the
metrics file (training loop only: evaluation is not in it). The time of a run is the median of
the epochs after the first (the first includes Numba compilation and cache warm-up). Every
configuration is run ``--repeats`` times, configurations alternating (A B C, C B A, ...), and
the tables report median times and the median of the per-repeat ratios.

Run: ``python bench/scaling.py --help``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import (
    RESULTS_DIR,
    DefaultsFormatter,
    ForeignLoad,
    Parser,
    add_mpiexec_flag,
    add_quiet_flags,
    busy_warning,
    can_plot,
    data_dir_problem,
    distinct_int_list,
    fmt_num,
    format_table,
    int_list,
    load_avg,
    machine_info,
    measure_quietly,
    median,
    nonempty_path,
    nonneg_int,
    out_path,
    pipeline_problem,
    plot_path,
    positive_int,
    pyplot_agg,
    refuse_unwritable,
    run_job,
    run_main,
    save_figure,
    timed_epochs,
    write_json,
)

NAME = "scaling"
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA_DIR = Path("/usr/share/datasets/fashion-mnist")
TARGET_SPEEDUP = 1.8  # 2 ranks x 1 thread vs 1 rank x 1 thread, MLP 784-1024-1024-10, 60k
TARGET_HIDDEN = (1024, 1024)
TARGET_SAMPLES = 60_000


def hidden_sizes(text: str) -> str:
    return ",".join(str(v) for v in int_list(text))


def batch_size(text: str) -> int | str:
    """A positive global batch, or ``full`` (full-batch gradient descent)."""
    return "full" if text == "full" else positive_int(text)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="bench/scaling.py",
        description="Strong and weak scaling of `python -m xpnn` under mpiexec.",
        formatter_class=DefaultsFormatter,
    )
    a = p.add_argument
    a("--ranks", type=distinct_int_list, default=[1, 2], help="rank counts N (1 always added)")
    a("--mode", choices=("strong", "weak", "both"), default="both")
    a("--dataset", choices=("fashion-mnist", "mnist", "synthetic"), default="fashion-mnist")
    a(
        "--data-dir",
        type=nonempty_path,
        default=None,
        help=f"IDX directory (default: {DEFAULT_DATA_DIR} for fashion-mnist if present; "
        "for mnist, xpnn's own lookup: its download cache)",
    )
    a("--synthetic-size", type=positive_int, default=60_000, help="synthetic train samples")
    a("--hidden", type=hidden_sizes, default="1024,1024", help="MLP hidden sizes")
    a("--backend", choices=("numpy", "numba"), default="numba")
    a("--threads-per-rank", type=positive_int, default=1)
    a("--comm", choices=("auto", "mpi-shm", "mpi-host"), default="auto", help="xpnn --comm")
    a("--compare-threads", action="store_true", help="add 1 rank x (max N x threads) threads")
    a("--epochs", type=timed_epochs, default=2, help="epochs per run; the first is dropped")
    a("--repeats", type=positive_int, default=3, help="runs per configuration (alternated)")
    a(
        "--batch-size",
        type=batch_size,
        default=128,
        help="GLOBAL batch (strong scaling), or 'full': one step per epoch, as seed report 000",
    )
    a("--per-rank-batch", type=positive_int, default=128, help="batch per rank (weak scaling)")
    a("--optimizer", choices=("sgd", "momentum", "adam"), default="adam", help="xpnn --optimizer")
    a(
        "--parallel",
        choices=("data", "tensor", "pipeline"),
        default="data",
        help="xpnn --parallel (tensor, pipeline: strong scaling only, every rank sees the "
        "whole batch)",
    )
    a("--microbatches", type=positive_int, default=None, help="xpnn --microbatches (pipeline)")
    a(
        "--pipeline-schedule",
        choices=("gpipe", "1f1b"),
        default=None,
        help="xpnn --pipeline-schedule (pipeline)",
    )
    a("--recompute", action="store_true", help="xpnn --recompute (pipeline)")
    a("--seed", type=nonneg_int, default=0, help="xpnn --seed")
    add_quiet_flags(a, "run", retries=3, quiet_timeout=300.0)
    add_mpiexec_flag(a)
    a("--timeout", type=positive_int, default=1800, help="seconds allowed per run")
    a("--out", type=out_path, default=RESULTS_DIR, help="output directory")
    a("--json", type=out_path, default=None, help=f"JSON file (default OUT/{NAME}.json)")
    a("--plot", type=plot_path, default=None, help=f"plot (default OUT/{NAME}.png)")
    return p


# --------------------------------------------------------------------------- runs


@dataclass(frozen=True)
class RunSpec:
    """One distinct ``mpiexec -n ranks python -m xpnn ...`` invocation."""

    ranks: int
    threads: int
    samples: int  # training samples per epoch
    replicate: int  # --replicate (IDX datasets, weak scaling)
    synthetic_size: int
    global_batch: int | str | None  # --batch-size (a number or "full"), or None (per rank)
    per_rank_batch: int | None

    @property
    def label(self) -> str:
        batch = (
            f"batch {self.global_batch}"
            if self.global_batch is not None
            else f"{self.per_rank_batch}/rank"
        )
        return f"{self.ranks}r x {self.threads}t, {self.samples} samples, {batch}"


def default_data_dir(dataset: str) -> str | None:
    """The ``--data-dir`` used when none is given: Debian's Fashion-MNIST for fashion-mnist
    only. Other data sets get none, so that xpnn looks them up itself (never the wrong files)."""
    if dataset == "fashion-mnist" and DEFAULT_DATA_DIR.is_dir():
        return str(DEFAULT_DATA_DIR)
    return None


def find_mpiexec(flag: str | None) -> str | None:
    """``--mpiexec`` (checked by ``executable``), else the venv's, else PATH's, else None."""
    if flag:
        return flag
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else shutil.which("mpiexec")


def mpiexec_path(flag: str | None) -> str:
    found = find_mpiexec(flag)
    if found is None:
        raise SystemExit("scaling: mpiexec not found (install MPI or pass --mpiexec)")
    return found


def refuse_without_mpiexec(parser: argparse.ArgumentParser, flag: str | None) -> None:
    """A usage error now, rather than a failure when the first run starts."""
    if find_mpiexec(flag) is None:
        parser.error("--mpiexec: none given, and no mpiexec next to this Python or on PATH")


def command(args: argparse.Namespace, spec: RunSpec, metrics: Path) -> list[str]:
    cmd = [
        mpiexec_path(args.mpiexec), "-n", str(spec.ranks), sys.executable, "-m", "xpnn",
        "--backend", args.backend, "--model", "mlp", "--hidden", args.hidden,
        "--dataset", args.dataset, "--epochs", str(args.epochs), "--seed", str(args.seed),
        "--threads", str(spec.threads), "--metrics", str(metrics), "--no-progress",
        "--comm", args.comm, "--optimizer", args.optimizer, "--parallel", args.parallel,
    ]  # fmt: skip
    if args.microbatches is not None:
        cmd += ["--microbatches", str(args.microbatches)]
    if args.pipeline_schedule is not None:
        cmd += ["--pipeline-schedule", args.pipeline_schedule]
    if args.recompute:
        cmd += ["--recompute"]
    if args.dataset == "synthetic":
        cmd += ["--synthetic-size", str(spec.synthetic_size)]
    elif args.data_dir:
        cmd += ["--data-dir", args.data_dir]
    if spec.replicate > 1:
        cmd += ["--replicate", str(spec.replicate)]
    if spec.per_rank_batch is not None:
        cmd += ["--per-rank-batch", str(spec.per_rank_batch)]
    else:
        cmd += ["--batch-size", str(spec.global_batch)]
    return cmd


def epoch_time(records: list[dict]) -> tuple[float, list[float]]:
    """(median seconds of the epochs after the first, every epoch's seconds)."""
    seconds = [float(r["seconds"]) for r in records if r.get("event") == "epoch"]
    if len(seconds) < 2:  # --epochs is 2 at least: the run stopped early
        raise RuntimeError(f"the metrics file has {len(seconds)} epoch record(s), 2 needed")
    return median(seconds[1:]), seconds


def run_once(args: argparse.Namespace, spec: RunSpec, workdir: Path) -> dict[str, Any]:
    metrics = workdir / f"m_{spec.ranks}_{spec.threads}_{spec.samples}.jsonl"
    cmd = command(args, spec, metrics)
    t0 = time.perf_counter()
    with ForeignLoad() as fl:
        run_job(cmd, args.timeout)
    wall = time.perf_counter() - t0
    records = [json.loads(s) for s in metrics.read_text().splitlines() if s.strip()]
    t, epochs = epoch_time(records)
    first = next(r for r in records if r.get("event") == "epoch")
    return {
        "time_s": t,
        "epoch_seconds": [round(s, 4) for s in epochs],
        "wall_s": round(wall, 3),
        "foreign_cores": fl.cores,
        "comm": first.get("comm"),
        "world_size": first.get("world_size"),
        "parallel": first.get("parallel"),
        **{k: first[k] for k in ("microbatches", "pipeline_schedule", "recompute") if k in first},
        "threads_reported": first.get("threads"),
    }


# --------------------------------------------------------------------------- plan


def dataset_samples(args: argparse.Namespace) -> int:
    if args.dataset == "synthetic":
        return args.synthetic_size
    return 60_000  # mnist and fashion-mnist training sets


def plan(args: argparse.Namespace) -> dict[str, list[tuple[str, RunSpec]]]:
    """Rows of each table as (row label, run spec); equal specs are run once and shared."""
    ranks = sorted(set([1, *args.ranks]))
    base = dataset_samples(args)
    t = args.threads_per_rank
    tables: dict[str, list[tuple[str, RunSpec]]] = {}
    if args.mode in ("strong", "both"):
        rows = [
            (f"{n} x {t}", RunSpec(n, t, base, 1, args.synthetic_size, args.batch_size, None))
            for n in ranks
        ]
        if args.compare_threads:
            big = max(ranks) * t
            rows.append(
                (
                    f"1 x {big}",
                    RunSpec(1, big, base, 1, args.synthetic_size, args.batch_size, None),
                )
            )
        tables["strong"] = rows
    if args.mode in ("weak", "both"):
        rows = []
        synthetic = args.dataset == "synthetic"
        for n in ranks:
            # synthetic: an n times larger set; IDX data sets: the training set repeated n times
            size = args.synthetic_size * n if synthetic else args.synthetic_size
            replicate = 1 if synthetic else n
            spec = RunSpec(n, t, base * n, replicate, size, None, args.per_rank_batch)
            rows.append((f"{n} x {t}", spec))
        tables["weak"] = rows
    return tables


def canonical(spec: RunSpec) -> RunSpec:
    """Specs that make the same command: one rank with batch B == one rank with B per rank."""
    if spec.ranks == 1 and spec.per_rank_batch is not None:
        return RunSpec(
            1, spec.threads, spec.samples, spec.replicate, spec.synthetic_size,
            spec.per_rank_batch, None,
        )  # fmt: skip
    return spec


# --------------------------------------------------------------------------- report


def paired_ratios(num: list[float], den: list[float]) -> list[float]:
    """num[r] / den[r] for each repeat r (runs of the same repeat are adjacent in time)."""
    return [a / b for a, b in zip(num, den, strict=False)]


def paired_median_ratio(num: list[float], den: list[float]) -> float:
    """Median over repeats of num[r] / den[r]."""
    return median(paired_ratios(num, den))


def summarise(
    tables: dict[str, list[tuple[str, RunSpec]]], runs: dict[RunSpec, list[dict]]
) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for kind, rows in tables.items():
        ref = canonical(rows[0][1])  # N = 1 with threads-per-rank threads
        ref_times = [r["time_s"] for r in runs[ref]]
        entries = []
        for label, spec in rows:
            times = [r["time_s"] for r in runs[canonical(spec)]]
            ratio = paired_median_ratio(ref_times, times)  # T1 / TN
            cores = spec.ranks * spec.threads
            entries.append(
                {
                    "row": label,
                    "samples": spec.samples,
                    "ranks": spec.ranks,
                    "threads_per_rank": spec.threads,
                    "global_batch": spec.global_batch
                    if spec.global_batch is not None
                    else spec.per_rank_batch * spec.ranks,
                    "time_s": median(times),
                    "times_s": times,  # unrounded: the targets' per-repeat ratios use them
                    "speedup": ratio if kind == "strong" else None,
                    # strong: speedup per core used (= speedup / N with 1 thread per rank);
                    # weak: T1 / TN, the data per rank being fixed
                    "efficiency": ratio / (cores / (ref.ranks * ref.threads))
                    if kind == "strong"
                    else ratio,
                    "foreign_cores": [r["foreign_cores"] for r in runs[canonical(spec)]],
                    "comm": runs[canonical(spec)][0]["comm"],
                }
            )
        out[kind] = entries
    return out


def print_tables(summary: dict[str, list[dict]]) -> None:
    if "strong" in summary:
        print("\nStrong scaling (fixed data set, fixed global batch)")
        headers = ["Data (No.)", "Ranks x threads", "Time (s)", "min-max (s)", "Speedup", "Eff."]
        rows = [
            [
                str(e["samples"]),
                e["row"],
                fmt_num(e["time_s"]),
                f"{min(e['times_s']):.3g}-{max(e['times_s']):.3g}",
                fmt_num(e["speedup"]),
                fmt_num(e["efficiency"]),
            ]
            for e in summary["strong"]
        ]
        print(format_table(headers, rows))
    if "weak" in summary:
        print("\nWeak scaling (fixed data and batch per rank)")
        headers = ["Data (No.)", "Ranks x threads", "Time (s)", "min-max (s)", "Eff. (T1/TN)"]
        rows = [
            [
                str(e["samples"]),
                e["row"],
                fmt_num(e["time_s"]),
                f"{min(e['times_s']):.3g}-{max(e['times_s']):.3g}",
                fmt_num(e["efficiency"]),
            ]
            for e in summary["weak"]
        ]
        print(format_table(headers, rows))


def targets(args: argparse.Namespace, summary: dict[str, list[dict]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    strong = summary.get("strong")
    if not strong or args.parallel != "data":  # the targets are data parallelism's (issue 3)
        return out
    by = {(e["ranks"], e["threads_per_rank"]): e for e in strong}
    same = (
        tuple(int(h) for h in args.hidden.split(",")) == TARGET_HIDDEN
        and dataset_samples(args) == TARGET_SAMPLES
    )
    note = "" if same else " (config differs from the target's MLP 784-1024-1024-10 on 60,000)"
    one, two, threads = by.get((1, 1)), by.get((2, 1)), by.get((1, 2))
    speedups = [] if one is None or two is None else paired_ratios(one["times_s"], two["times_s"])
    out.append(
        {
            "name": "strong speedup 2 ranks x 1 thread vs 1 rank x 1 thread" + note,
            "target": f">= {TARGET_SPEEDUP}",
            "value": None if two is None else two["speedup"],
            "pass": None if two is None else two["speedup"] >= TARGET_SPEEDUP,
            "per_repeat": speedups,
            "repeats_meeting": sum(r >= TARGET_SPEEDUP for r in speedups),
        }
    )
    ratios = []  # > 1: the ranks are faster than the threads
    if two is not None and threads is not None:
        ratios = paired_ratios(threads["times_s"], two["times_s"])
    out.append(
        {
            "name": "2 ranks x 1 thread faster than 1 rank x 2 threads (T(1x2) / T(2x1))" + note,
            "target": "> 1",
            "value": median(ratios) if ratios else None,
            "pass": median(ratios) > 1.0 if ratios else None,
            "per_repeat": ratios,
            "repeats_meeting": sum(r > 1.0 for r in ratios),
        }
    )
    return out


def print_targets(tgt: list[dict[str, Any]]) -> None:
    """Each target's verdict on the median, and how many repeats met it: on a noisy machine
    one run's verdict says little when the repeats straddle the target."""
    if not tgt:
        return
    print("\ntargets (informational):")
    for t in tgt:
        verdict = "not measured" if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
        got = "-" if t["value"] is None else f"{t['value']:.3f}"  # 1.796 is not 1.80
        each = t["per_repeat"]
        spread = ""
        if len(each) > 1:
            spread = (
                f"; per repeat {min(each):.3f}-{max(each):.3f}, {t['repeats_meeting']} of "
                f"{len(each)} meet it"
            )
        print(f"  {verdict:<12} {t['name']}: {got} (target {t['target']}{spread})")


def plot(summary: dict[str, list[dict]], path: Path, title: str) -> None:
    plt = pyplot_agg()
    fig, (ax_t, ax_e) = plt.subplots(1, 2, figsize=(10, 4))
    styles = {"strong": ("o-", "strong"), "weak": ("s--", "weak")}
    for kind, entries in summary.items():
        pts = [e for e in entries if e["threads_per_rank"] == entries[0]["threads_per_rank"]]
        ns = [e["ranks"] * e["threads_per_rank"] for e in pts]  # cores used, as the axis says
        fmt, label = styles[kind]
        ax_t.plot(ns, [e["time_s"] for e in pts], fmt, label=f"{label} scaling")
        ax_e.plot(ns, [e["efficiency"] for e in pts], fmt, label=f"{label} scaling")
        for e in entries:
            if e not in pts:  # the threads comparison row: same cores, one process
                cores = e["ranks"] * e["threads_per_rank"]
                name = f"1 rank x {e['threads_per_rank']} threads"
                ax_t.plot([cores], [e["time_s"]], "x", markersize=10, label=name)
                ax_e.plot([cores], [e["efficiency"]], "x", markersize=10, label=name)
    all_n = sorted({e["ranks"] * e["threads_per_rank"] for es in summary.values() for e in es})
    ax_e.plot(all_n, [1.0] * len(all_n), ":", color="grey", label="ideal")
    ax_t.set_xlabel("cores used (ranks x threads per rank)")
    ax_t.set_ylabel("time per epoch (s)")
    ax_e.set_xlabel("cores used (ranks x threads per rank)")
    ax_e.set_ylabel("parallel efficiency")
    ax_e.set_ylim(0, 1.2)
    for ax in (ax_t, ax_e):
        ax.set_xticks(all_n)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_figure(fig, path, title)


# --------------------------------------------------------------------------- main


def run(args: argparse.Namespace) -> int:
    tables = plan(args)
    order: list[RunSpec] = list(
        dict.fromkeys(canonical(s) for rows in tables.values() for _, s in rows)
    )
    from xpnn.runtime import node_cores  # the affinity mask, or a CPU quota's cores

    cores = node_cores()
    for spec in order:
        if spec.ranks * spec.threads > cores:
            print(
                f"warning: {spec.ranks} ranks x {spec.threads} threads = "
                f"{spec.ranks * spec.threads} > {cores} cores: oversubscribed, "
                "so this row measures contention, not scaling",
                flush=True,
            )
    warn = busy_warning()
    if warn:
        print(warn, flush=True)
    print(
        f"{NAME}: mlp 784-{args.hidden.replace(',', '-')}-10, {args.parallel} parallel, "
        f"{args.backend}, {args.dataset}, "
        f"{args.epochs} epochs/run (time = median of epochs after the first), "
        f"{args.repeats} repeats, {len(order)} distinct configurations",
        flush=True,
    )
    runs: dict[RunSpec, list[dict]] = {s: [] for s in order}
    with tempfile.TemporaryDirectory(prefix="xpnn-scaling-") as tmp:
        for r in range(args.repeats):
            for spec in order if r % 2 == 0 else order[::-1]:
                try:
                    res, _, redone = measure_quietly(
                        lambda spec=spec: run_once(args, spec, Path(tmp)),
                        args.max_foreign,
                        args.retries,
                        args.quiet_timeout,
                    )
                except RuntimeError as exc:  # RunFailed, or a metrics file short of epochs
                    print(f"scaling: {exc}", file=sys.stderr)
                    return 1
                res["redone_noisy"] = redone
                runs[spec].append(res)
                print(
                    f"  repeat {r + 1}/{args.repeats}  {spec.label:<40} {res['time_s']:.3f} s/epoch"
                    f"  (epochs {res['epoch_seconds']}, others used {res['foreign_cores']} cores"
                    f", {redone} noisy runs redone)",
                    flush=True,
                )
    summary = summarise(tables, runs)
    print_tables(summary)
    tgt = targets(args, summary)
    print_targets(tgt)
    json_path = args.json or args.out / f"{NAME}.json"
    plot_path = args.plot or args.out / f"{NAME}.png"
    title = (
        f"xpnn MLP 784-{args.hidden.replace(',', '-')}-10, {args.parallel} parallel, "
        f"{args.backend}, {args.dataset}, mpiexec, {cores} CPUs"
    )
    if args.draw_plot:
        plot(summary, plot_path, title)
    write_json(
        json_path,
        {
            "benchmark": NAME,
            "machine": machine_info(),
            "config": {
                k: (str(v) if isinstance(v, Path) else v)
                for k, v in vars(args).items()
                if k not in ("json", "plot", "out", "draw_plot")
            },
            "load_avg_end": load_avg(),
            "strong": summary.get("strong"),
            "weak": summary.get("weak"),
            "runs": [{"spec": vars_spec(s), "results": runs[s]} for s in order],
            "targets": tgt,
        },
    )
    print(f"\nwrote {json_path}" + (f"\nwrote {plot_path}" if args.draw_plot else ""))
    return 0


def vars_spec(spec: RunSpec) -> dict[str, Any]:
    return {
        "ranks": spec.ranks,
        "threads": spec.threads,
        "samples": spec.samples,
        "replicate": spec.replicate,
        "global_batch": spec.global_batch,
        "per_rank_batch": spec.per_rank_batch,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.parallel != "data" and args.mode != "strong":
        parser.error(
            f"--parallel {args.parallel}: every rank sees the whole batch; use --mode strong"
        )
    if args.parallel == "pipeline":  # xpnn's rule, before the first run rather than by it
        hidden = [int(h) for h in args.hidden.split(",")]
        for n in sorted(set(args.ranks)):
            problem = pipeline_problem("mlp", hidden, n)
            if problem:
                parser.error(f"--ranks {n}: {problem}")
    if args.data_dir is None:
        args.data_dir = default_data_dir(args.dataset)
    elif args.dataset != "synthetic":
        problem = data_dir_problem(args.dataset, args.data_dir)
        if problem:
            parser.error(problem)
    if args.json is None or args.plot is None:  # some file goes to its default place in --out
        refuse_unwritable(parser, "--out", args.out, folder=True)
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path is not None:
            refuse_unwritable(parser, flag, path)
    refuse_without_mpiexec(parser, args.mpiexec)
    args.draw_plot = can_plot(parser, args.plot is not None)
    return run(args)


if __name__ == "__main__":
    run_main(main)
