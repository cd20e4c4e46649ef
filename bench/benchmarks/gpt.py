"""The character-level GPT (``--model gpt``, its recipe and default sizes) beside a native
``torch.nn`` GPT of the same architecture and recipe (``_gpt_torch``): training tokens per
second and peak resident memory, one process with ``--threads`` threads (``one``: sharing each
product; ``batch-threads``: each running a twin of the model on a part of the batch), one
process of one thread (``one-thread``: what each of 2 ranks has), and 2 ranks of one thread each
under data, tensor and pipeline parallelism, with the bytes each mode sends per step (counted by
the communicators: the metrics file's ``comm_bytes_per_step``).

xpnn trains through its command line, ``--steps 2K --eval-every K``: the second span's
``tokens_per_s`` is the number (the first holds Numba's compilation). Each repeat runs every
side in turn, the order flipped each repeat, so a shared machine's drift hits all sides.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.core import (
    RunFailed,
    done_of,
    markdown_table,
    median_of,
    record,
    run_command,
    run_xpnn,
    spread,
    xpnn_command,
)
from bench.flags import positive_float, positive_int

NAME = "gpt"
SUMMARY = "the GPT's tokens/s, peak memory and bytes per step, 1 process and 2 ranks, vs torch"
QUICK = {"steps": 2, "repeats": 1, "layers": 1, "embed": 16, "heads": 2, "block": 8}
QUICK |= {"modes": "one,batch-threads,data,tensor,pipeline,torch"}
MODES = ("one", "batch-threads", "one-thread", "data", "tensor", "pipeline", "torch")


def add_arguments(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a("--text", help="a UTF-8 file to train on (default: tiny Shakespeare, --data-dir or cache)")
    a("--data-dir", help="tiny Shakespeare's input.txt or its directory (offline)")
    a("--steps", type=positive_int, default=30, help="timed steps a side (after as many untimed)")
    a("--repeats", type=positive_int, default=3, help="rounds of every side, order flipped each")
    a("--threads", type=positive_int, default=2, help="threads of the one process (xpnn and torch)")
    a("--backend", default="numba", help="xpnn --backend")
    a("--microbatches", type=positive_int, default=4, help="pipeline micro-batches")
    for name, default in (("layers", 4), ("heads", 4), ("embed", 128), ("block", 64)):
        a(f"--{name}", type=positive_int, default=default)
    a("--batch-size", type=positive_int, default=32)
    a("--modes", default=",".join(MODES), help="of " + ",".join(MODES))
    a("--timeout", type=positive_float, default=1800, help="seconds per run")


def _data_flags(args: argparse.Namespace) -> list[str]:
    if args.text:
        return ["--dataset", "text", "--data-dir", args.text]
    return ["--dataset", "tinyshakespeare", *(["--data-dir", args.data_dir] * bool(args.data_dir))]


def _text_file(args: argparse.Namespace) -> str:
    """The file the torch side reads: ``--text``, or tiny Shakespeare as xpnn finds it."""
    if args.text:
        return args.text
    from xpnn.data import shakespeare_path

    return str(shakespeare_path(args.data_dir))


def _sizes(args: argparse.Namespace) -> list[str]:
    return [f"--{n}={getattr(args, n)}" for n in ("layers", "heads", "embed", "block")]


def xpnn_flags(args: argparse.Namespace, mode: str) -> tuple[int, list[str]]:
    """(ranks, flags) of ``python -m xpnn`` for ``mode``."""
    flags = ["--model", "gpt", *_sizes(args), *_data_flags(args), "--backend", args.backend]
    flags += ["--batch-size", str(args.batch_size), "--no-progress"]
    flags += ["--steps", str(2 * args.steps), "--eval-every", str(args.steps)]
    if mode == "one":
        return 1, [*flags, "--threads", str(args.threads), "--batch-threads", "1"]
    if mode == "batch-threads":
        return 1, [*flags, "--threads", str(args.threads), "--batch-threads", str(args.threads)]
    if mode == "one-thread":
        return 1, [*flags, "--threads", "1"]
    flags += ["--threads", "1", "--parallel", mode, "--comm", "mpi-host"]
    if mode == "pipeline":
        flags += ["--microbatches", str(args.microbatches)]
    return 2, flags


def measure_xpnn(args: argparse.Namespace, mode: str) -> dict[str, float]:
    ranks, flags = xpnn_flags(args, mode)
    metrics = run_xpnn(ranks, flags, args.timeout)
    evals = [m for m in metrics if m.get("event") == "eval"]
    if len(evals) < 2:
        raise RunFailed(f"python -m xpnn {' '.join(flags)}: fewer than 2 eval records")
    peak = done_of(metrics).get("peak_rss_mb")  # a rank's each, where ranks differ
    return {
        "tokens_per_s": evals[-1]["tokens_per_s"],
        "peak_rss_mb": max(peak) if isinstance(peak, list) else peak,
        "comm_bytes_per_step": evals[-1]["comm_bytes_per_step"],
        "val_loss": evals[-1]["val_loss"],
    }


def measure_torch(args: argparse.Namespace, text: str) -> dict[str, float]:
    cmd = [sys.executable, "-m", "bench.benchmarks._gpt_torch", "--text", text]
    cmd += [*_sizes(args), "--batch", str(args.batch_size), "--threads", str(args.threads)]
    cmd += ["--steps", str(args.steps), "--warmup", str(args.steps)]
    out = json.loads(run_command(cmd, args.timeout).strip().splitlines()[-1])
    return {"tokens_per_s": out["tokens_per_s"], "peak_rss_mb": out["peak_rss_mb"]}


def run(args: argparse.Namespace, machine: dict[str, Any]) -> list[dict[str, Any]]:
    modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise argparse.ArgumentTypeError(f"--modes: unknown {unknown} ({', '.join(MODES)})")
    with tempfile.TemporaryDirectory(prefix="xpnn-gpt-bench-") as tmp:
        text = _text_file(args) if "torch" in modes else str(Path(tmp) / "none")
        samples: dict[str, dict[str, list[float]]] = {m: {} for m in modes}
        for r in range(args.repeats):
            for mode in modes[:: 1 if r % 2 == 0 else -1]:
                got = measure_torch(args, text) if mode == "torch" else measure_xpnn(args, mode)
                print(f"  {mode}: {got}", flush=True)
                for key, value in got.items():
                    if value is not None:
                        samples[mode].setdefault(key, []).append(float(value))
    out = []
    for mode in modes:
        config = {"mode": mode, "steps": args.steps, "batch_size": args.batch_size}
        config |= {n: getattr(args, n) for n in ("layers", "heads", "embed", "block", "threads")}
        if mode != "torch":
            ranks, flags = xpnn_flags(args, mode)
            config |= {"ranks": ranks, "command": " ".join(xpnn_command(ranks, flags))}
        else:
            config |= {"ranks": 1, "command": "python -m bench.benchmarks._gpt_torch"}
        out.append(record(NAME, config, samples[mode], machine))
    return out


def table(records: list[dict[str, Any]]) -> str:
    torch = next((median_of(r, "tokens_per_s") for r in records if r["config"]["mode"] == "torch"),
                 None)  # fmt: skip
    rows = []
    for r in records:
        rate = median_of(r, "tokens_per_s")
        sent = median_of(r, "comm_bytes_per_step")
        rows.append([
            r["config"]["mode"], r["config"]["ranks"], spread(r, "tokens_per_s"),
            None if not (torch and rate) else rate / torch, spread(r, "peak_rss_mb"),
            None if sent is None else sent / 2**20,
        ])  # fmt: skip
    heads = ["mode", "ranks", "tokens/s", "x torch", "peak RSS MB", "MiB sent per step"]
    return markdown_table(heads, rows)


def plot(records: list[dict[str, Any]], ax: Any) -> None:
    names = [r["config"]["mode"] for r in records]
    ax.bar(names, [median_of(r, "tokens_per_s") or 0 for r in records], color="C0")
    ax.set(ylabel="tokens/s", title="GPT: xpnn modes and torch")
