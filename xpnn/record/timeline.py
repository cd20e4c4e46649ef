"""``python -m xpnn trace DIR``: the ranks' traces on rank 0's clock, and where a step goes."""

import glob
import json
import math
import os
import re
import statistics
import sys
from typing import Any

from xpnn.errors import UserError
from xpnn.record.files import check_output, read_regular, replace_whole
from xpnn.record.plot import OneLineParser, draw_timeline  # matplotlib only when drawing

Interval = tuple[float, float]
FLIGHT_LANE = 90  # the flight recorder's operations, beside the trace's own lanes
FLIGHT_ARGS = ("nbytes", "bucket", "microbatch", "step", "peer", "group")  # an operation's


def parse_steps(text: str) -> tuple[int, int]:
    """``A:B``: steps A to B-1 (counted over the run from 0); raises ValueError."""
    first, sep, last = text.partition(":")
    if not sep or not first.strip().isdigit() or not last.strip().isdigit():
        raise ValueError(f"{text!r}: expected A:B, e.g. 3:8")
    start, stop = int(first), int(last)
    if stop <= start:
        raise ValueError(f"{text!r}: B must be greater than A")
    return start, stop


MOST_BYTES = 1 << 30  # a rank file of a few traced steps is kilobytes; a GiB is no trace


def rank_files(directory: str, stem: str) -> dict[int, str]:
    name = re.compile(rf"{stem}-rank(\d+)\.json$")
    paths = glob.glob(os.path.join(glob.escape(directory), f"{stem}-rank*.json"))
    return {int(match[1]): path for path in paths if (match := name.search(path))}


def load_ranks(directory: str, stem: str) -> dict[int, dict[str, Any]]:
    """``{rank: document}`` of ``directory/{stem}-rank{N}.json``, each checked."""
    found: dict[int, dict[str, Any]] = {}
    for rank, path in rank_files(directory, stem).items():
        data = read_regular(path, MOST_BYTES, f"trace {path}", "a rank file")
        try:
            doc = json.loads(data)
        except ValueError as exc:
            raise UserError(f"trace {path}: not a readable JSON file ({exc})") from None
        if problem := (_trace_problem if stem == "trace" else _flight_problem)(doc):
            raise UserError(f"trace {path}: not a rank file xpnn wrote ({problem})")
        found[rank] = doc
    return found


def number(value: Any) -> bool:  # a JSON number, finite (never a bool)
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def numbers(values: Any, n: int) -> bool:  # a list of ``n`` of them
    return isinstance(values, list) and len(values) == n and all(map(number, values))


def _trace_problem(doc: Any) -> str | None:
    """What in a ``trace-rank{N}.json`` is not as xpnn writes it (None: nothing)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return "no traceEvents list"
    for event in doc["traceEvents"]:
        if not isinstance(event, dict):
            return f"an event that is {event!r}"
        if "ts" in event and not number(event["ts"]):
            return f"an event's ts is {event['ts']!r}"
        if "ts" in event and not number(event.get("dur")):
            return f"an event without a duration ({event.get('name')!r})"
        typed = zip(("name", "cat", "pid", "tid"), (str, str, int, int), strict=True)
        if event.get("ph") == "X" and not all(isinstance(event.get(k), t) for k, t in typed):
            return f"a span without a name, category, pid or tid ({event!r:.80})"
    other = doc.get("otherData", {})
    xpnn = other.get("xpnn", {}) if isinstance(other, dict) else None
    clock = xpnn.get("clock") or [] if isinstance(xpnn, dict) else None
    if not isinstance(clock, list) or not all(numbers(pair, 2) for pair in clock):
        return "otherData.xpnn is not as xpnn writes it"
    return None


def _flight_problem(doc: Any) -> str | None:
    """What in a ``flight-rank{N}.json`` is not as xpnn writes it (None: nothing)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("operations"), list):
        return "no operations list"
    if not number(doc.get("now")):
        return f"now is {doc.get('now')!r}"
    for op in doc["operations"]:
        if not isinstance(op, dict) or not number(op.get("start")):
            return f"an operation without a start ({op!r:.80})"
        if not (op.get("end") is None or number(op["end"])):
            return f"an operation's end is {op['end']!r}"
    return None


def clock_offsets(traces: dict[int, dict[str, Any]]) -> dict[int, float]:
    """Each rank's clock minus rank 0's (us): the middle of the bounds the barriers set."""
    samples = {
        r: t.get("otherData", {}).get("xpnn", {}).get("clock") or [] for r, t in traces.items()
    }
    reference = samples.get(0) or []
    offsets = {}
    for rank, own in samples.items():
        if not (pairs := list(zip(own, reference, strict=False))):
            offsets[rank] = 0.0
            continue
        low = max(entry - left0 for (entry, _), (_, left0) in pairs)
        high = min(left - entry0 for (_, left), (entry0, _) in pairs)
        middles = [(e + x) / 2 - (e0 + x0) / 2 for (e, x), (e0, x0) in pairs]
        # where the bounds do not meet, a rank held up: the median of the barriers' middles
        offsets[rank] = (low + high) / 2 if low <= high else statistics.median(middles)
    return offsets


def merge(directory: str) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """One trace of every rank on rank 0's clock (starting at 0), and each rank's xpnn info."""
    traces, flights = load_ranks(directory, "trace"), load_ranks(directory, "flight")
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
    for rank, dump in sorted(flights.items()):  # operations as spans, the unfinished to the dump
        ops, offset = dump.get("operations", []), offsets.get(rank, 0.0)
        for op in ops:
            end = op["end"] if op["end"] is not None else dump["now"]
            name = f"{op['op']} #{op['seq']}" + ("" if op["end"] is not None else " (unfinished)")
            args = {k: op.get(k) for k in FLIGHT_ARGS}
            events.append(span_event(rank, name, "flight", FLIGHT_LANE, op["start"], end, args))
            events[-1]["ts"] -= offset
        if ops:
            lane = f"flight recorder ({dump.get('reason', '')})"
            events.append(lane_meta("thread_name", rank, FLIGHT_LANE, name=lane))
    origin = min((e["ts"] for e in events if "ts" in e), default=0.0)
    for event in events:
        if "ts" in event:
            event["ts"] = round(event["ts"] - origin, 3)
            event["dur"] = round(event["dur"], 3)
    info = {r: t.get("otherData", {}).get("xpnn", {}) for r, t in traces.items()}
    for rank in info:
        info[rank]["clock_offset_us"] = round(offsets.get(rank, 0.0), 1)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"xpnn": info}}, info


def span_event(pid: int, name: str, cat: str, tid: int, t0: float, t1: float, args: Any) -> dict:
    """A Chrome trace event from ``t0`` to ``t1``, in seconds (an ``X``: a complete span)."""
    event = {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid}
    event["ts"], event["dur"] = t0 * 1e6, max(0.0, t1 - t0) * 1e6
    return event | ({"args": args} if args else {})


def lane_meta(kind: str, pid: int, tid: int, **args: Any) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}


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
    return length(overlap_list(a, b))


def overlap_list(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The intersection of two unions, as intervals."""
    out, j = [], 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            lo, hi = max(start, b[k][0]), min(end, b[k][1])
            if lo < hi:
                out.append((lo, hi))
            k += 1
    return union(out)


def _spans(events: Any) -> list[Interval]:
    return union([(e["ts"], e["ts"] + e["dur"]) for e in events])


def summarize(merged: dict[str, Any], info: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank, over its traced steps: where the step time went (ms), hidden and bubble shares."""
    rows = []
    for rank in sorted({e["pid"] for e in merged["traceEvents"] if e.get("cat") == "step"}):
        mine = [e for e in merged["traceEvents"] if e.get("pid") == rank and e.get("ph") == "X"]
        spans = {
            c: _spans(e for e in mine if e["cat"] == c) for c in ("step", "communication", "wait")
        }
        steps, comm = spans["step"], spans["communication"]
        in_steps, waiting = overlap(comm, steps), overlap(spans["wait"], steps)
        step_time = length(steps)
        row: dict[str, Any] = {"rank": rank, "steps": sum(1 for e in mine if e["cat"] == "step")}
        row |= {"step_ms": step_time / 1e3, "compute_ms": (step_time - waiting) / 1e3}
        row |= {"communication_ms": in_steps / 1e3, "waiting_ms": waiting / 1e3}
        row |= dict.fromkeys(("hidden", "bubble", "schedule_bubble"))
        if in_steps > 0:
            exposed = overlap(overlap_list(comm, steps), spans["wait"])
            row["hidden"] = max(0.0, 1.0 - exposed / in_steps)
        meta = info.get(rank, {})
        if meta.get("parallel") == "pipeline" and meta.get("stages"):
            busy = _spans(e for e in mine if e["cat"] == "span" and "micro-batch" in e["name"])
            work = length(busy) - overlap(busy, spans["wait"])
            row["bubble"] = 1.0 - work / step_time if step_time else None
            p, m = meta["stages"], meta["microbatches"]
            row["schedule_bubble"] = (p - 1) / (m + p - 1)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], info: dict[int, dict[str, Any]]) -> list[str]:
    head = ["rank", "steps", "step ms", "compute", "communication", "waiting", "hidden"]
    pipeline = any(r["bubble"] is not None for r in rows)
    head += (["bubble", "(p-1)/(m+p-1)"] if pipeline else []) + ["clock offset"]
    lines = ["  ".join(f"{h:>13}" if i else f"{h:>4}" for i, h in enumerate(head))]
    for r in rows:
        n = max(r["steps"], 1)
        cells = [f"{r['rank']:>4}", f"{r['steps']:>13}", f"{r['step_ms'] / n:>13.2f}"]
        for key in ("compute_ms", "communication_ms", "waiting_ms"):
            share = r[key] / r["step_ms"] if r["step_ms"] else 0.0
            cells.append(f"{f'{r[key] / n:.2f} ({share:.0%})':>13}")
        shares = ("hidden", "bubble", "schedule_bubble") if pipeline else ("hidden",)
        cells += [f"{'–' if r[k] is None else format(r[k], '.0%'):>13}" for k in shares]
        cells.append(f"{info.get(r['rank'], {}).get('clock_offset_us', 0.0):>10.1f} us")
        lines.append("  ".join(cells))
    return lines


def main(argv: list[str]) -> int:
    about = "Merge the per-rank traces (--trace DIR) and flight records of DIR into one Chrome "
    about += "trace and print where each rank's step time goes."
    parser = OneLineParser(prog="python -m xpnn trace", description=about)
    parser.said = "trace: "
    parser.add_argument("directory", help="the --trace directory (or one with flight records)")
    parser.add_argument("-o", "--output", help="the merged trace (default DIR/merged.json)")
    parser.add_argument("--png", help="also draw the last two traced steps (needs matplotlib)")
    try:
        args = parser.parse_args(argv)
        if not os.path.isdir(args.directory):
            raise UserError(f"trace {args.directory}: not a directory")
        out = args.output or os.path.join(args.directory, "merged.json")
        traced = rank_files(args.directory, "trace")
        reads = [*traced.values(), *rank_files(args.directory, "flight").values()]
        check_output(f"trace -o {out}", out, reads, "a rank file")
        if args.png:
            check_output(f"trace --png {args.png}", args.png, reads, "a rank file", ".png")
        try:
            merged, info = merge(args.directory)
            rows = summarize(merged, info)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            why = f"rank files not as xpnn writes them ({type(exc).__name__}: {exc})"
            raise UserError(f"trace {args.directory}: {why}") from None
        try:
            replace_whole(out, json.dumps(merged).encode())  # never through a planted link
        except OSError as exc:
            raise UserError(f"trace -o {out}: {exc.strerror}") from None
        if args.png:
            if not any(e.get("cat") == "step" for e in merged["traceEvents"]):
                raise UserError("trace --png: no traced steps to draw (flight records only)")
            try:
                draw_timeline(merged, args.png)
            except ImportError:
                raise UserError("trace --png: needs matplotlib (pip install matplotlib)") from None
            except OSError as exc:
                raise UserError(f"trace --png {args.png}: {exc.strerror}") from None
    except UserError as exc:
        print("xpnn: " + " | ".join(filter(str.strip, str(exc).splitlines())), file=sys.stderr)
        return 2
    ranks = len({e["pid"] for e in merged["traceEvents"] if "pid" in e})
    print(f"merged {ranks} rank(s) into {out} (open it in https://ui.perfetto.dev)")
    if traced and 0 not in traced:
        why = "the ranks' clocks are not aligned to rank 0's (their offsets show as 0)"
        print(f"no trace-rank0.json in {args.directory}: {why}")
    if rows:
        print("per step, ms (share of the step); hidden: communication overlapped by compute")
        print("\n".join(table(rows, info)))
    return 0
