"""``python -m bench report [--quick] [--out DIR]``: the seeds' studies, measured now, as
``DIR/index.md`` with a PNG per study beside it and every record in ``DIR/records.jsonl``."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

from bench import benchmarks
from bench.benchmarks import parse
from bench.core import (
    ROOT,
    BenchError,
    describe_machine,
    load_now,
    machine_line,
    markdown_table,
    marks,
    median_of,
    noise_notes,
    now,
    read_records,
    stamp,
    write_records,
)
from bench.flags import nonneg_float, positive_int
from bench.plots import draw, pyplot
from bench.predicted import LABEL, NO_GPU, annotate, why_none
from bench.quiet import wait_below_cores
from xpnn.errors import UserError
from xpnn.planner import load as load_calibration

# The newest recording of the GPU benchmarks (files named gpu-MACHINE-YYYY-MM-DD.jsonl)
RECORDED_GPU = max(
    (Path(__file__).resolve().parent / "recorded").glob("gpu-*.jsonl"),
    key=lambda p: p.stem[-10:],
    default=None,
)

# The seed reports' own numbers, printed beside ours (shared/seeds/000 and 002).
SEED000_STRONG = [(1, 43.67), (2, 23.79), (4, 14.81), (6, 12.17), (8, 11.01)]
SEED000_WEAK = [
    (1, 5000, 4.3),
    (2, 10000, 4.97),
    (4, 20000, 5.65),
    (6, 30000, 6.51),
    (8, 40000, 7.68),
]
SEED002 = [(1, 142.04, 0.0441, 98.80), (2, 82.06, 0.0559, 98.43), (4, 34.40, 0.0659, 98.28),
           (8, 20.52, 0.0912, 97.20)]  # fmt: skip

REPRODUCING = ROOT / "docs" / "reproducing.md"
# What a quick report (a smoke test) predicts from unless given --calibration: measuring this
# machine's products would take as long as the quick measurements themselves.
QUICK_CALIBRATION = (
    Path(__file__).resolve().parent / "recorded" / "calibration-plan-accuracy-2cpu-2026-11-29b.json"
)


def seeds_text(out: Path) -> str:
    """The paragraph naming the seed reports, its link to reproducing.md made from ``out``
    (a clone's docs); without the docs (an installed package) the page is named, not linked."""
    if REPRODUCING.is_file():
        link = Path(os.path.relpath(REPRODUCING.resolve(), out.resolve())).as_posix()
        where = f"[Reproducing the reports]({link})"
    else:
        where = "Reproducing the reports (docs/reproducing.md in xpnn's source)"
    return (
        "Each section repeats the experiment of one seed report, the five reports (course "
        "reports, a blog post, a project proposal) whose questions xpnn answers, numbered 000 "
        f"to 004: {where} names each one, gives its exact commands and compares its numbers "
        "with these.\n"
    )


def this_run(records: list[dict[str, Any]], start: bool = True) -> str:
    """The caption of a table of this run's numbers: a quick run says so before a report's
    published numbers are set beside it."""
    words = "This run" if start else "this run"
    if any(r.get("quick") for r in records):
        return f"{words} (**QUICK RUN: small sizes, a smoke test, not comparable** to the report)"
    return words


def notes(records: list[dict[str, Any]]) -> str:
    """The marks and noisy measurements under a study's table ('' when there are none)."""
    text = "\n\n".join(t for t in (noise_notes(records), why_none(records)) if t)
    return f"{text}\n" if text else ""


STUDIES = ("scaling", "cnn", "granularity", "batch_regimes", "parallel_modes", "gpu")


def seed000_tables() -> tuple[str, str]:
    t1 = SEED000_STRONG[0][1]
    strong = [[60000, n, t, t1 / t, t1 / t / n] for n, t in SEED000_STRONG]
    w1 = SEED000_WEAK[0][2]
    weak = [[d, n, t, w1 / t * n, w1 / t] for n, d, t in SEED000_WEAK]
    heads = ["samples", "processors", "time s", "speedup", "efficiency"]
    return markdown_table(heads, strong), markdown_table(heads, weak)


def seed002_table() -> str:
    heads = ["processes", "global batch", "epoch s", "speedup", "test loss", "test acc %"]
    rows = [[n, 128 * n, t, SEED002[0][1] / t, loss, acc] for n, t, loss, acc in SEED002]
    return markdown_table(heads, rows)


def command_line(records: list[dict[str, Any]]) -> str:
    """The last run's command, as an example of the study's runs."""
    return f"A run of this study: `{records[-1]['config']['command']}`." if records else ""


def words(names: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def modes_sentence(records: list[dict[str, Any]]) -> str:
    """When each mode wins, read from this run's numbers, in sentences."""
    if not records:
        return ""
    by = {r["config"]["mode"]: r for r in records}

    def least(value: Any) -> tuple[list[str], float]:
        low = min(value(m) for m in by)
        return [m for m in by if value(m) == low], low

    def who(names: list[str], single: str, shared: str) -> str:
        if len(names) == len(by):
            return f"every mode {shared}"
        return f"{words([f'`{n}`' for n in names])} {single if len(names) == 1 else shared}"

    fastest, seconds = least(lambda m: median_of(by[m], "epoch_s"))
    leanest, mb = least(lambda m: median_of(by[m], "peak_rss_mb") or float("inf"))
    sent = {m: median_of(by[m], "comm_bytes_per_step") for m in by}  # 0 is a count, None not
    fewest, low = least(lambda m: float("inf") if sent[m] is None else sent[m])
    memory = f"the least memory per rank ({mb:.0f} MB)"
    if leanest == fastest:
        first = (
            f"{who(fastest, 'was', 'were')} fastest ({seconds:.2f} s per epoch) and needed {memory}"
        )
    else:
        first = (
            f"{who(fastest, 'was', 'were')} fastest ({seconds:.2f} s per epoch) and "
            f"{who(leanest, 'needed', 'needed')} {memory}"
        )
    return (
        f"In this run {first}; {who(fewest, 'sent', 'sent')} the fewest bytes per step "
        f"({low / 2**20:.2f} MiB, all ranks together). One run on a shared machine. Data "
        "parallelism wins while the model fits on every rank and its gradients are cheap to "
        "sum against the batch's arithmetic; "
        "tensor and pipeline parallelism win when the model or its activations do not fit one "
        "rank (they split the parameters), tensor when the batch is small relative to the "
        "weights, pipeline when links are slow (only the cut activations travel) and there "
        "are enough micro-batches to hide its bubble."
    )


def _gpu_section(args: argparse.Namespace, machine: dict[str, Any], out: Path) -> tuple[str, list]:
    if machine.get("gpu"):
        cross = benchmarks.load("crossover").run(parse("crossover", [], args.quick), machine)
        ar_args = parse("allreduce", ["--device"], args.quick)
        allr = benchmarks.load("allreduce").run(ar_args, machine)
    return _gpu_text(out, *((cross, allr) if machine.get("gpu") else ([], [])))


def _gpu_text(out: Path, cross: list, allr: list) -> tuple[str, list]:
    """The GPU section from this run's records, else from the newest recording."""
    if cross:
        head = "Measured in this run on " + cross[0]["machine"]["gpu"]["name"] + "."
    elif RECORDED_GPU is None:
        return "**Not run here: this machine has no GPU**, and no GPU results are recorded.", []
    else:
        cross = read_records(RECORDED_GPU, "crossover")
        allr = read_records(RECORDED_GPU, "allreduce")
        m = cross[0]["machine"]
        head = (
            "**Not run here: this machine has no GPU.** The last recorded GPU results follow, "
            f"measured on {m['gpu']['name']} ({m['cpu']}, {m['blas'][0]['internal_api']} "
            f"{m['blas'][0]['version']}), dated {cross[0]['time']} "
            f"(`bench/recorded/{RECORDED_GPU.name}`; {cross[0]['info']['source']})."
        )
    draw(out / "gpu.png", [
        lambda ax: no_gpu_prediction(benchmarks.load("crossover").plot, cross, ax),
        lambda ax: benchmarks.load("allreduce").plot(allr, ax),
    ], notes=marks(cross + allr))  # fmt: skip
    text = (
        f"{head}\n\nCPU vs GPU matrix product (ms):\n\n{benchmarks.load('crossover').table(cross)}"
        f"\n\n**{NO_GPU[0].upper()}{NO_GPU[1:]}**: the planner's calibration measures this "
        "machine's CPU and MPI only, so no predicted crossover is drawn beside the GPU's."
        f"\n\nAllreduce, host vs device buffers:\n\n{benchmarks.load('allreduce').table(allr)}"
        f"\n\n{notes(cross + allr)}\n![GPU](gpu.png)"
    )
    return text, cross + allr if head.startswith("Measured") else []


def no_gpu_prediction(plot: Any, records: list[dict[str, Any]], ax: Any) -> None:
    """The crossover's panel, saying in it that nothing is predicted there."""
    plot(records, ax)
    ax.text(0.02, 0.02, NO_GPU, transform=ax.transAxes, fontsize=8, color="C3")


def predictions_text(calibration: str | None, measured: dict[str, Any] | None) -> str:
    """How the predicted lines and columns were computed, for which machine, and whether
    that is the machine that measured (``measured``: a record's machine)."""
    load = load_now()["load1"]
    busy = "unknown" if load is None else f"{load:.1f}"
    if calibration:
        key = load_calibration(calibration).key
        cpu, cores = key.get("cpu"), key.get("cores")
        source = (
            f"the calibration file `{calibration}` ({cpu}, {cores} cores, BLAS "
            f"{key.get('blas')}, NumPy {key.get('numpy')})"
        )
    else:
        here = describe_machine()
        cpu, cores = here["cpu"], here["cores"]
        source = (
            f"this machine's cached calibration ({cpu}, {cores} cores; `python -m xpnn "
            f"calibrate`; what it lacked measured as the predictions were drawn, {now()}, "
            f"load average {busy})"
        )
    text = (
        "Each study's figure and table set the planner's prediction beside the measured "
        f'points ("{LABEL}"): each run\'s own command line (model, batch, ranks, threads, '
        "layout) priced by `python -m xpnn plan`'s cost model (docs/planning.md) on "
        f"{source}; an epoch is the predicted step times the training samples over the "
        "global batch (rounded up), the training time that times the epochs. The model "
        "prices the training steps only (no start-up, data loading or test pass)."
    )
    if measured and (measured.get("cpu"), measured.get("cores")) != (cpu, cores):
        text += (
            f" **Predicted for another machine than the one measured** ({measured.get('cpu')}, "
            f"{measured.get('cores')} cores): a gap between the lines is that difference as "
            "much as the model's error."
        )
    return text + "\n"


def panels(name: str, records: list[dict[str, Any]]) -> list[Any]:
    """The panels of a study's figure: its ``plot``, and bytes per step for parallel modes."""
    mod = benchmarks.load(name)
    drawn = [lambda ax: mod.plot(records, ax)]
    if hasattr(mod, "plot_bytes"):
        drawn.append(lambda ax: mod.plot_bytes(records, ax))
    return drawn


def _study(name: str, args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    flags = ["--dataset", args.dataset, *(["--data-dir", args.data_dir] if args.data_dir else [])]
    if name in ("scaling", "cnn", "granularity"):
        flags += ["--ranks", args.ranks]
    if name == "parallel_modes":
        flags += ["--ranks", str(max(int(r) for r in args.ranks.split(",")))]
    flags += ["--repeats", str(args.repeats or (1 if args.quick else 3))]
    return benchmarks.load(name).run(parse(name, flags, args.quick), machine)


def build(args: argparse.Namespace) -> Path:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    pyplot()  # fail now, not after the measurements, without matplotlib
    quiet = wait_below_cores(args.quiet_wait) if args.quiet_wait else None
    machine = describe_machine()
    load = load_now()["load1"]
    t0 = time.perf_counter()
    shipped = str(QUICK_CALIBRATION) if args.quick and QUICK_CALIBRATION.is_file() else None
    calibration = args.calibration or shipped
    rec: dict[str, list[dict[str, Any]]] = {}
    for name in [s for s in STUDIES if s != "gpu" and s in args.only]:
        print(f"report: {name} ...", flush=True)
        rec[name] = _study(name, args, machine)
        stamp(rec[name], args.quick, quiet)
        annotate(rec[name], calibration)
        draw(out / f"{name}.png", panels(name, rec[name]), notes=marks(rec[name]))
    gpu_text, gpu_rec = _gpu_section(args, machine, out) if "gpu" in args.only else ("", [])
    stamp(gpu_rec, args.quick, quiet)
    records_file = out / "records.jsonl"
    records_file.unlink(missing_ok=True)
    write_records(records_file, [r for rs in rec.values() for r in rs] + gpu_rec)
    size = (
        "quick (small sizes, a smoke test: not comparable to the reports)" if args.quick else "full"
    )
    header = [
        "# xpnn: the seed reports' studies, measured on this machine\n",
        f"Generated {now()} by `python -m bench report{' --quick' if args.quick else ''}` "
        f"({size}; data: {args.dataset}; measuring took {time.perf_counter() - t0:.0f} s).\n",
        f"**Machine:** {machine_line(machine)}; host {machine['host']}, {machine['os']}.\n",
        "Timings on a shared machine are noisy (load average when the report started: "
        f"{'unknown' if load is None else f'{load:.1f}'} on {machine['usable_cores']} usable "
        "cores): each timing is a median, with its range (min–max) and the number of repeats "
        "n; a measurement whose range is wider than 1.3× or that ran with more threads "
        "runnable than cores is marked † and listed under its table with the reason; the "
        "command, machine, load and versions of every run are in `records.jsonl`.\n",
    ]
    predictions = predictions_text(calibration, machine)
    return render(out, header, rec, gpu_text, predictions)


def redraw(out: Path, calibration: str | None = None) -> Path:
    """The text and figures of the report in ``out`` again from its ``records.jsonl`` (and its
    header, which describes the measurement), measuring nothing."""
    pyplot()
    records = read_records(out / "records.jsonl")
    rec = {s: [r for r in records if r["benchmark"] == s] for s in STUDIES if s != "gpu"}
    rec = {s: rs for s, rs in rec.items() if rs}
    for name, rs in rec.items():
        annotate(rs, calibration)
        draw(out / f"{name}.png", panels(name, rs), notes=marks(rs))
    by = {b: [r for r in records if r["benchmark"] == b] for b in ("crossover", "allreduce")}
    gpu_text, _ = _gpu_text(out, by["crossover"], by["allreduce"])
    index = out / "index.md"
    old = index.read_text() if index.is_file() else "# xpnn: the seed reports' studies\n"
    head = old.split("\n## ")[0].split("\nEach section repeats")[0].rstrip("\n") + "\n"
    measured = next((r["machine"] for rs in rec.values() for r in rs), None)
    return render(out, [head], rec, gpu_text, predictions_text(calibration, measured))


def render(
    out: Path, header: list[str], rec: dict[str, list], gpu_text: str, predictions: str = ""
) -> Path:
    """``out/index.md``: ``header``, what the predictions are, then a section per study in
    ``rec``, then ``gpu_text``."""
    strong000, weak000 = seed000_tables()
    sc = benchmarks.load("scaling")
    parts = [*header, seeds_text(out), predictions if rec else ""]
    if "scaling" in rec:
        parts += [
            "## Seed 000: strong and weak scaling (sigmoid MLP, BCE, full-batch GD)\n",
            f"One hidden layer of {rec['scaling'][0]['config']['hidden']} sigmoid units (the "
            "report does not give its width), one rank per core, 1 BLAS thread each. "
            f"{command_line(rec['scaling'])}\n",
            f"Strong scaling, {this_run(rec['scaling'], False)}:\n\n"
            f"{sc.table(rec['scaling'], 'strong')}"
            "\n\nA speedup above the rank count is marked ‡ and says whether the repeats' "
            "range explains it.\n",
            f"The report's Table 1 (i7-6700K, 4 cores, mpi4py; its times and speedups, the "
            f"efficiency computed from them):\n\n{strong000}\n",
            f"Weak scaling, {this_run(rec['scaling'], False)}:\n\n"
            f"{sc.table(rec['scaling'], 'weak')}\n",
            notes(rec["scaling"]),
            f"The report's Table 2 (its times; speedup and efficiency computed from them):"
            f"\n\n{weak000}\n",
            "![scaling](scaling.png)\n",
        ]
    if "cnn" in rec:
        parts += [
            "## Seed 002: the 690,590-parameter CNN, batch 128 per process, lr 0.001 × processes\n",
            f"{command_line(rec['cnn'])}\n",
            f"{this_run(rec['cnn'])}:\n\n{benchmarks.load('cnn').table(rec['cnn'])}\n",
            notes(rec["cnn"]),
            "The report's Table 2 (one node, Adam, 5 epochs, MNIST; its times, losses and "
            f"accuracies, the speedup computed from them):\n\n{seed002_table()}\n",
            "![cnn](cnn.png)\n",
        ]
    if "granularity" in rec:
        parts += [
            "## Seed 003: granularity, speedup as the work per sample grows\n",
            f"{command_line(rec['granularity'])}\n",
            f"{this_run(rec['granularity'])}:\n\n"
            f"{benchmarks.load('granularity').table(rec['granularity'])}\n",
            notes(rec["granularity"]),
            "![granularity](granularity.png)\n",
        ]
    if "batch_regimes" in rec:
        br = benchmarks.load("batch_regimes")
        r0 = rec["batch_regimes"][0]["config"]
        parts += [
            "## Seed 004: steps to a target accuracy against the global batch\n",
            f"Target test accuracy {r0['target']}, SGD, lr tuned per batch size from "
            f"{sorted({r['config']['lr'] for r in rec['batch_regimes']})}; the test set scored "
            "at steps about 10 % apart, the step interpolated between the scores either side "
            "of the target.\n",
            "The study again, with the rates that won: "
            f"`{br.example_command(rec['batch_regimes'])}`.\n",
            f"{this_run(rec['batch_regimes'])}:\n\n{br.table(rec['batch_regimes'])}\n",
            notes(rec["batch_regimes"]),
            "![batch regimes](batch_regimes.png)\n",
        ]
    if "parallel_modes" in rec:
        pm = rec["parallel_modes"]
        parts += [
            "## Data vs tensor vs pipeline parallelism (same MLP, same global batch)\n",
            f"MLP 784-{pm[0]['config']['hidden'].replace(',', '-')}-10, global batch "
            f"{pm[0]['config']['batch_size']}, {pm[0]['config']['ranks']} ranks; bytes per "
            "step: the payload all ranks together hand to MPI, as the communicators count it.\n",
            f"{command_line(pm)}\n",
            f"{this_run(pm)}:\n\n{benchmarks.load('parallel_modes').table(pm)}\n",
            notes(pm),
            modes_sentence(pm) + "\n",
            "![parallel modes](parallel_modes.png)\n",
        ]
    if gpu_text:
        parts += ["## CPU vs GPU: matmul crossover and allreduce host vs device\n", gpu_text]
    index = out / "index.md"
    index.write_text("\n".join(part for part in parts if part) + "\n")
    return index


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check(out: Path) -> list[str]:
    """What is wrong with a built report: a table without rows, a missing or invalid PNG."""
    import re

    index = out / "index.md"
    if not index.is_file():
        return [f"{index}: missing"]
    text = index.read_text()
    problems = []
    for block in re.split(r"\n\s*\n", text):
        lines = [ln for ln in block.strip().splitlines() if ln.startswith("|")]
        if lines and len(lines) < 3:  # a header and its rule, no row
            problems.append(f"a table without rows: {lines[0]}")
    pngs = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", text)
    if not pngs:
        problems.append("no figure")
    for name in pngs:
        png = out / name
        if not png.is_file() or png.read_bytes()[:8] != PNG_SIGNATURE:
            problems.append(f"{png}: missing or not a PNG")
    if "|" not in text:
        problems.append("no table")
    return problems + unmarked_quick(out, text)


def unmarked_quick(out: Path, text: str) -> list[str]:
    """A section that sets a quick run beside a seed report's published numbers without
    saying it is quick (the records say which runs were quick)."""
    records_file = out / "records.jsonl"
    quick = {r["benchmark"] for r in read_records(records_file) if r.get("quick")} if (
        records_file.is_file()) else set()  # fmt: skip
    if not quick:
        return []
    return [
        f"section {section.splitlines()[0]!r}: a quick run without its QUICK RUN mark"
        for section in text.split("\n## ")[1:]
        if section.startswith("Seed ") and "QUICK RUN" not in section
    ]


def check_out_dir(out: Path) -> None:
    """The report's folder: a directory or nothing yet (then made, its parent must exist);
    never a file, a device or a link, which the report would write through or beside."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise BenchError(f"--out {out}: exists and is not a directory; give a directory")
    if not out.exists() and not out.parent.is_dir():
        raise BenchError(f"--out {out}: no such directory {out.parent}")


def check_calibration(path: str | None) -> None:
    """A ``--calibration`` file that cannot be read is refused before anything is measured."""
    if path:
        try:
            load_calibration(path)
        except UserError as exc:
            raise BenchError(f"--calibration: {exc}") from None


def main(argv: list[str]) -> int:
    p = _Parser(prog="python -m bench report", description=__doc__, allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="small sizes, one repeat (minutes)")
    p.add_argument("--out", type=Path, default=Path("report"), help="directory (default report/)")
    p.add_argument(
        "--dataset", default="synthetic", choices=("synthetic", "mnist", "fashion-mnist")
    )
    p.add_argument("--data-dir")
    p.add_argument(
        "--repeats", type=positive_int, help="runs per configuration (default 3; 1 quick)"
    )
    p.add_argument(
        "--quiet-wait", type=nonneg_float, default=0.0, metavar="SECONDS",
        help="first wait up to this long for the load average to fall below the cores",
    )  # fmt: skip
    p.add_argument("--ranks", default="1,2", help="rank counts of the scaling studies")
    p.add_argument("--only", default=",".join(STUDIES), help=f"comma list of {', '.join(STUDIES)}")
    p.add_argument(
        "--calibration", metavar="FILE",
        help="predict from this xpnn calibration file (default: this machine's, cached)",
    )  # fmt: skip
    p.add_argument(
        "--check", action="store_true", help="check the report in --out, measure nothing"
    )
    p.add_argument(
        "--redraw",
        action="store_true",
        help="write the text and figures of the report in --out again from its records.jsonl",
    )
    try:
        args = p.parse_args(argv)
        if args.check:
            problems = check(args.out)
            for line in problems:
                print(f"report: {line}", file=sys.stderr)
            print(f"report: {args.out / 'index.md'}: " + ("bad" if problems else "ok"))
            return 1 if problems else 0
        check_out_dir(args.out)
        check_calibration(args.calibration)
        if args.redraw:
            if not (args.out / "records.jsonl").is_file():
                raise BenchError(f"--out {args.out}: holds no records.jsonl to redraw from")
            print(f"report: {redraw(args.out, args.calibration)} (drawn again from records.jsonl)")
            return 0
        args.only = [s for s in args.only.split(",") if s]
        unknown = [s for s in args.only if s not in STUDIES]
        if unknown:
            raise BenchError(
                f"--only: unknown {', '.join(unknown)} (choose from {', '.join(STUDIES)})"
            )
        t0 = time.perf_counter()
        index = build(args)
    except BenchError as e:
        print(f"bench report: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"bench report: --out {args.out}: cannot write ({e.strerror or e})", file=sys.stderr)
        return 2
    print(f"report: {index} ({time.perf_counter() - t0:.0f} s)")
    return 0


class _Parser(argparse.ArgumentParser):
    """A bad flag is one line naming it, exit 2, no usage block."""

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        raise BenchError(message.removeprefix("argument "))
