"""``python -m xpnn trace DIR``: every rank's ``trace-rank{N}.json`` (and the flight recorder's
``flight-rank{N}.json``) merged into one Chrome trace on rank 0's clock, and a summary per rank:
compute, communication, waiting, the communication hidden behind compute, a pipeline's bubble."""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys
from typing import Any

from xpnn.errors import UserError
from xpnn.files import replace_whole

Interval = tuple[float, float]
FLIGHT_LANE = 90  # the flight recorder's operations, beside the trace's own lanes


def parse_steps(text: str) -> tuple[int, int]:
    """``A:B``: steps A to B-1 (counted over the run from 0); raises ValueError."""
    first, sep, last = text.partition(":")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit():
        raise ValueError(f"{text!r}: expected A:B, e.g. 3:8")
    start, stop = int(first), int(last)
    if stop <= start:
        raise ValueError(f"{text!r}: B must be greater than A")
    return start, stop


def load_ranks(directory: str, stem: str) -> dict[int, dict[str, Any]]:
    """``{rank: document}`` of ``directory/{stem}-rank{N}.json``."""
    found: dict[int, dict[str, Any]] = {}
    for path in glob.glob(os.path.join(directory, f"{stem}-rank*.json")):
        match = re.search(rf"{stem}-rank(\d+)\.json$", path)
        if not match:
            continue
        try:
            with open(path) as fh:
                found[int(match[1])] = json.load(fh)
        except (OSError, ValueError) as exc:
            raise UserError(f"trace {path}: not a readable JSON file ({exc})") from None
    return found


def clock_offsets(traces: dict[int, dict[str, Any]]) -> dict[int, float]:
    """Each rank's clock minus rank 0's (us). A barrier ends after the last rank entered and
    before the first left, so each barrier bounds the offset between (rank's entry - rank 0's
    exit) and (rank's exit - rank 0's entry); the bounds of all barriers are intersected and
    the middle taken (where a rank was held up so long that they do not meet, the median of
    the barriers' middles)."""
    samples = {
        r: t.get("otherData", {}).get("xpnn", {}).get("clock") or [] for r, t in traces.items()
    }
    reference = samples.get(0) or []
    offsets = {}
    for rank, own in samples.items():
        pairs = list(zip(own, reference, strict=False))
        if not pairs:
            offsets[rank] = 0.0
            continue
        low = max(entry - left0 for (entry, _), (_, left0) in pairs)
        high = min(left - entry0 for (_, left), (entry0, _) in pairs)
        middles = [(e + x) / 2 - (e0 + x0) / 2 for (e, x), (e0, x0) in pairs]
        offsets[rank] = (low + high) / 2 if low <= high else statistics.median(middles)
    return offsets


def flight_events(rank: int, dump: dict[str, Any], offset: float) -> list[dict[str, Any]]:
    """A flight dump's operations as spans (unfinished ones end at the dump)."""
    events = []
    for op in dump.get("operations", []):
        end = op["end"] if op["end"] is not None else dump["now"]
        name = f"{op['op']} #{op['seq']}" + ("" if op["end"] is not None else " (unfinished)")
        args = {k: op[k] for k in ("nbytes", "bucket", "microbatch", "step", "peer", "group")}
        events.append(
            {"name": name, "cat": "flight", "ph": "X", "pid": rank, "tid": FLIGHT_LANE,
             "ts": op["start"] * 1e6 - offset, "dur": max(0.0, end - op["start"]) * 1e6,
             "args": args}
        )  # fmt: skip
    if events:
        lane = f"flight recorder ({dump.get('reason', '')})"
        events.append(
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": FLIGHT_LANE}
            | {"args": {"name": lane}}
        )
    return events


def merge(directory: str) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """One trace of every rank on rank 0's clock (starting at 0), and each rank's xpnn info."""
    traces = load_ranks(directory, "trace")
    flights = load_ranks(directory, "flight")
    if not traces and not flights:
        raise UserError(f"trace {directory}: no trace-rank*.json or flight-rank*.json in it")
    offsets = clock_offsets(traces)
    events: list[dict[str, Any]] = []
    for rank, trace in sorted(traces.items()):
        for event in trace.get("traceEvents", []):
            event = dict(event)
            if "ts" in event:
                event["ts"] -= offsets.get(rank, 0.0)
            events.append(event)
    for rank, dump in sorted(flights.items()):
        events.extend(flight_events(rank, dump, offsets.get(rank, 0.0)))
    timed = [e["ts"] for e in events if "ts" in e]
    origin = min(timed) if timed else 0.0
    for event in events:
        if "ts" in event:
            event["ts"] = round(event["ts"] - origin, 3)
            event["dur"] = round(event["dur"], 3)
    info = {r: t.get("otherData", {}).get("xpnn", {}) for r, t in traces.items()}
    for rank in info:
        info[rank]["clock_offset_us"] = round(offsets.get(rank, 0.0), 1)
    merged = {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"xpnn": info}}
    return merged, info


def union(intervals: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def length(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def overlap(a: list[Interval], b: list[Interval]) -> float:
    """Total length of the intersection of two unions."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += max(0.0, min(end, b[k][1]) - max(start, b[k][0]))
            k += 1
    return total


def summarize(merged: dict[str, Any], info: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank, over its traced steps (ms): step time, compute, communication, waiting, the
    fraction of communication hidden behind compute, a pipeline stage's bubble."""
    rows = []
    ranks = sorted({e["pid"] for e in merged["traceEvents"] if e.get("cat") == "step"})
    for rank in ranks:
        mine = [e for e in merged["traceEvents"] if e.get("pid") == rank and e.get("ph") == "X"]
        spans = {cat: union([(e["ts"], e["ts"] + e["dur"]) for e in mine if e["cat"] == cat])
                 for cat in ("step", "communication", "wait")}  # fmt: skip
        steps = spans["step"]
        comm = spans["communication"]
        in_steps = overlap(union(comm), steps)
        waiting = overlap(spans["wait"], steps)
        step_time = length(steps)
        row = {
            "rank": rank,
            "steps": sum(1 for e in mine if e["cat"] == "step"),
            "step_ms": step_time / 1e3,
            "compute_ms": (step_time - waiting) / 1e3,
            "communication_ms": in_steps / 1e3,
            "waiting_ms": waiting / 1e3,
            "hidden": None,
            "bubble": None,
            "schedule_bubble": None,
        }
        if in_steps > 0:
            exposed = overlap(overlap_list(union(comm), steps), spans["wait"])
            row["hidden"] = max(0.0, 1.0 - exposed / in_steps)
        meta = info.get(rank, {})
        if meta.get("parallel") == "pipeline" and meta.get("stages"):
            busy = union([(e["ts"], e["ts"] + e["dur"]) for e in mine
                          if e["cat"] == "span" and "micro-batch" in e["name"]])  # fmt: skip
            work = length(busy) - overlap(busy, spans["wait"])
            row["bubble"] = 1.0 - work / step_time if step_time else None
            p, m = meta["stages"], meta["microbatches"]
            row["schedule_bubble"] = (p - 1) / (m + p - 1)
        rows.append(row)
    return rows


def overlap_list(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The intersection of two unions, as intervals."""
    out = []
    for start, end in a:
        for s, e in b:
            lo, hi = max(start, s), min(end, e)
            if lo < hi:
                out.append((lo, hi))
    return union(out)


def table(rows: list[dict[str, Any]], offsets: dict[int, float]) -> list[str]:
    head = ["rank", "steps", "step ms", "compute", "communication", "waiting", "hidden"]
    pipeline = any(r["bubble"] is not None for r in rows)
    if pipeline:
        head += ["bubble", "(p-1)/(m+p-1)"]
    head.append("clock offset")
    lines = ["  ".join(f"{h:>13}" if i else f"{h:>4}" for i, h in enumerate(head))]
    for r in rows:
        n = max(r["steps"], 1)
        cells = [f"{r['rank']:>4}", f"{r['steps']:>13}", f"{r['step_ms'] / n:>13.2f}"]
        for key in ("compute_ms", "communication_ms", "waiting_ms"):
            share = r[key] / r["step_ms"] if r["step_ms"] else 0.0
            cells.append(f"{f'{r[key] / n:.2f} ({share:.0%})':>13}")
        cells.append(f"{'–' if r['hidden'] is None else format(r['hidden'], '.0%'):>13}")
        if pipeline:
            for key in ("bubble", "schedule_bubble"):
                cells.append(f"{'–' if r[key] is None else format(r[key], '.0%'):>13}")
        cells.append(f"{offsets.get(r['rank'], 0.0):>10.1f} us")
        lines.append("  ".join(cells))
    return lines


def main(argv: list[str]) -> int:
    """``python -m xpnn trace DIR [-o MERGED]``."""
    parser = argparse.ArgumentParser(
        prog="python -m xpnn trace",
        description="Merge the per-rank traces (--trace DIR) and flight records of DIR into one "
        "Chrome trace and print where each rank's step time goes.",
    )
    parser.add_argument("directory", help="the --trace directory (or one with flight records)")
    parser.add_argument("-o", "--output", help="the merged trace (default DIR/merged.json)")
    parser.add_argument("--png", help="also draw the last two traced steps (needs matplotlib)")
    args = parser.parse_args(argv)
    try:
        if not os.path.isdir(args.directory):
            raise UserError(f"trace {args.directory}: not a directory")
        merged, info = merge(args.directory)
        out = args.output or os.path.join(args.directory, "merged.json")
        try:
            replace_whole(out, json.dumps(merged).encode())  # never through a planted link
        except OSError as exc:
            raise UserError(f"trace -o {out}: {exc.strerror}") from None
        if args.png:
            _draw(merged, args.png)
    except UserError as exc:
        print(f"xpnn: {exc}", file=sys.stderr)
        return 2
    rows = summarize(merged, info)
    ranks = len({e["pid"] for e in merged["traceEvents"] if "pid" in e})
    print(f"merged {ranks} rank(s) into {out} (open it in https://ui.perfetto.dev)")
    if rows:
        print("per step, ms (share of the step); hidden: communication overlapped by compute")
        offsets = {r: i.get("clock_offset_us", 0.0) for r, i in info.items()}
        for line in table(rows, offsets):
            print(line)
    return 0


def _draw(merged: dict[str, Any], path: str) -> None:
    try:
        from xpnn.timeline_plot import draw
    except ImportError:  # pragma: no cover - matplotlib is the plot extra
        raise UserError("trace --png: needs matplotlib (pip install matplotlib)") from None
    if not any(e.get("cat") == "step" for e in merged["traceEvents"]):
        raise UserError("trace --png: no traced steps to draw (flight records only)")
    try:
        draw(merged, path)
    except ImportError:
        raise UserError("trace --png: needs matplotlib (pip install matplotlib)") from None
    except OSError as exc:
        raise UserError(f"trace --png {path}: {exc.strerror}") from None
