"""Timeline traces (``--trace``), their merge (``python -m xpnn trace``) and the flight recorder:
the interval arithmetic on its own, one process in-process, and real ``mpiexec -n 2`` runs of
data-parallel (bucket allreduces overlap backward), 1F1B pipeline (its schedule) and a rank
stopped with SIGSTOP under ``--stall-abort`` (the line names it; the ranks dump their records)."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from conftest import TINY_FLOAT64_RUN, assert_one_line_user_error, run_xpnn
from faults import Job

from xpnn.commands import cli
from xpnn.record import phases, timeline
from xpnn.runtime import flight
from xpnn.train.trace import default_window

ARGS = [*TINY_FLOAT64_RUN, "--hidden", "32,32"]


def _trace(path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def _spans(events: list[dict], pid: int, cat: str | None = None) -> list[dict]:
    found = [e for e in events if e.get("ph") == "X" and e["pid"] == pid]
    return sorted((e for e in found if cat is None or e["cat"] == cat), key=lambda e: e["ts"])


def test_interval_arithmetic():
    assert timeline.union([(3, 5), (0, 2), (1, 4)]) == [(0, 5)]
    assert timeline.overlap([(0, 10)], [(2, 3), (8, 12)]) == 3
    assert timeline.overlap_list([(0, 10)], [(2, 3), (8, 12)]) == [(2, 3), (8, 10)]
    assert timeline.length([(0, 2), (5, 6)]) == 3


def test_clock_offsets_are_bounded_by_every_barrier():
    def doc(clock):
        return {"otherData": {"xpnn": {"clock": clock}}}

    # rank 1's clock runs 100 ahead; it left the second barrier 500 late (descheduled)
    rank0 = [[0, 10], [20, 30], [40, 44]]
    rank1 = [[105, 108], [119, 630], [141, 146]]
    offsets = timeline.clock_offsets({0: doc(rank0), 1: doc(rank1)})
    assert offsets[0] == 0
    assert offsets[1] == pytest.approx(101.5)  # the bounds [97, 106] met; true 100
    apart = [[[0, 1], [10, 11]], [[500, 501], [600, 601]]]  # bounds [589, 501]: never meet
    assert timeline.clock_offsets({0: doc(apart[0]), 1: doc(apart[1])})[1] == 545  # middles


def test_the_summary_counts_hidden_and_exposed_communication():
    def x(name, cat, tid, ts, dur):
        return {"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": tid, "ts": ts, "dur": dur}

    merged = {
        "traceEvents": [
            x("step 3", "step", 1, 0, 100),
            x("allreduce #1", "communication", 10, 20, 60),  # 20..80
            x("wait allreduce #1", "wait", 1, 70, 10),  # 70..80: exposed
        ]
    }
    (row,) = timeline.summarize(merged, {0: {"parallel": "data"}})
    assert row["waiting_ms"] == pytest.approx(0.010)
    assert row["compute_ms"] == pytest.approx(0.090)
    assert row["communication_ms"] == pytest.approx(0.060)
    assert row["hidden"] == pytest.approx(50 / 60)
    assert row["bubble"] is None


@pytest.mark.parametrize("text", ["3", "5:5", "a:b", "7:2", ":4"])
def test_trace_steps_must_be_a_range(text):
    with pytest.raises(ValueError):
        timeline.parse_steps(text)


def test_the_default_window_skips_the_first_steps_when_it_can():
    assert default_window(100) == (3, 8)
    assert default_window(6) == (1, 6)
    assert default_window(2) == (0, 2)


def test_a_bad_trace_steps_names_its_flag():
    assert_one_line_user_error(run_xpnn([*ARGS, "--trace-steps", "4:2"]), "--trace-steps")


def test_trace_steps_without_trace_is_refused(tmp_path):
    proc = run_xpnn([*ARGS, "--trace-steps", "1:2"])
    assert_one_line_user_error(proc, "--trace-steps")
    assert "needs --trace" in proc.stderr


def test_a_trace_directory_that_cannot_be_made_is_said_at_the_start(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = run_xpnn([*ARGS, "--epochs", "100000", "--trace", str(blocker / "traces")])
    assert_one_line_user_error(proc, "--trace")


def test_one_process_traces_layers_loss_and_update(tmp_path, capsys):
    assert cli.main([*ARGS, "--trace", str(tmp_path), "--trace-steps", "1:4"]) == 0
    events = _trace(tmp_path / "trace-rank0.json")
    assert phases.tracer() is None  # the window closed: tracing off again
    steps = [e["name"] for e in _spans(events, 0, "step")]
    assert steps == ["step 1", "step 2", "step 3"]
    names = {e["name"] for e in _spans(events, 0)}
    assert {"forward 1 Dense", "backward 1 Dense", "loss", "update", "forward"} <= names
    (process,) = [e for e in events if e.get("name") == "process_name"]
    assert process["args"]["name"] == "rank 0 (host)"
    assert timeline.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "merged 1 rank(s)" in out and out.splitlines()[-1].split()[:2] == ["0", "3"]
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert min(e["ts"] for e in merged["traceEvents"] if "ts" in e) == 0


def test_a_short_steps_run_traces_the_window_its_own_length_gives(tmp_path):
    """``--steps`` sets the run's length, whatever ``--epochs`` says: 5 steps trace all 5."""
    run = [*ARGS, "--steps", "5", "--epochs", "40", "--trace", str(tmp_path)]
    assert cli.main(run) == 0
    steps = [e["name"] for e in _spans(_trace(tmp_path / "trace-rank0.json"), 0, "step")]
    assert steps == [f"step {i}" for i in range(*default_window(5))]


def test_a_phase_is_heard_whole_by_a_listener_that_comes_after_another_left_inside_it():
    """Nested entries reach a listener once; one that stops listening inside a phase does not
    leave the next listener deaf to it."""
    heard = []
    phases.listen(lambda name, entering: heard.append((name, entering)))
    try:
        with phases.WGRAD:
            with phases.WGRAD:
                pass
            phases.listen(None)
        phases.listen(lambda name, entering: heard.append((name, entering)))
        with phases.WGRAD:
            pass
    finally:
        phases.listen(None)
    assert heard == [("wgrad", True), ("wgrad", True), ("wgrad", False)]


def test_trace_of_an_empty_directory_is_one_line(tmp_path, capsys):
    assert timeline.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no trace-rank*.json" in err


@pytest.mark.mpi
def test_data_parallel_buckets_overlap_backward(tmp_path):
    args = ["--synthetic-size", "1000", "--batch-size", "200", "--hidden", "256,256"]
    args += ["--comm", "mpi-host", "--bucket-mb", "0.1", "--dtype", "float32"]
    proc = run_xpnn([*TINY_FLOAT64_RUN, *args, "--trace", str(tmp_path)], ranks=2)
    assert proc.returncode == 0, proc.stderr
    out = cli_trace(tmp_path)
    events = _trace(tmp_path / "merged.json")
    for rank in (0, 1):
        steps = _spans(events, rank, "step")
        assert len(steps) == 5
        step = steps[-1]
        inside = [e for e in _spans(events, rank) if step["ts"] <= e["ts"] < _end(step)]
        buckets = [e for e in inside if e["cat"] == "communication" and "bucket" in e["name"]]
        backward = [e for e in inside if e["name"].startswith("backward")]
        assert len(buckets) >= 2
        # the first bucket is posted while backward still runs: overlap
        assert buckets[0]["ts"] < _end(backward[-1]) - 1, (buckets[0], backward[-1])
        assert any(e["cat"] == "wait" for e in inside)
        assert {e["tid"] for e in buckets} >= {phases.COMMUNICATION}
    assert "hidden" in out.splitlines()[2] and len(out.splitlines()) == 5


def _end(event: dict) -> float:
    return event["ts"] + event["dur"]


def cli_trace(directory) -> str:
    proc = run_xpnn(["trace", str(directory)])
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.mpi
def test_a_1f1b_pipeline_trace_shows_its_schedule(tmp_path):
    args = ["--parallel", "pipeline", "--pipeline-schedule", "1f1b", "--microbatches", "4"]
    proc = run_xpnn([*ARGS, *args, "--trace", str(tmp_path)], ranks=2)
    assert proc.returncode == 0, proc.stderr
    out = cli_trace(tmp_path)
    events = _trace(tmp_path / "merged.json")
    expected = {  # 1F1B with 2 stages and 4 micro-batches
        0: ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
        1: ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"],
    }
    for rank, order in expected.items():
        step = _spans(events, rank, "step")[-1]
        micro = [
            e["name"][0].upper() + e["name"].split()[-1]
            for e in _spans(events, rank, "span")
            if "micro-batch" in e["name"] and step["ts"] <= e["ts"] < _end(step)
        ]
        assert micro == order
    header = out.splitlines()[2]
    assert "bubble" in header and "(p-1)/(m+p-1)" in header
    assert all(line.split()[-3] == "20%" for line in out.splitlines()[3:])  # (2-1)/(4+2-1)


def test_the_flight_line_names_who_never_entered():
    where = {"group": "4 ranks", "seq": 812, "op": "allreduce", "nbytes": 4 << 20, "peer": None}
    where |= {"bucket": 3, "microbatch": None, "step": 406}
    line = flight.describe({0: where, 2: where, 3: where}, [1], "ck/flight-rank*.json")
    assert line == (
        "rank 1 never entered allreduce #812 (4.0 MiB, bucket 3, step 406) or stopped in it; "
        "ranks 0, 2, 3 wait in it; flight records in ck/flight-rank*.json"
    )
    other = where | {"op": "broadcast"}
    assert flight.describe({0: where, 1: other}, [], None).startswith(
        "mismatch: the same operation number with different operations or sizes (rank 0 in "
        "allreduce #812"
    )
    later = where | {"seq": 813}
    assert flight.describe({0: where, 1: later}, [], None).startswith(
        "mismatch: ranks in different operations (rank 0 waits in allreduce #812"
    )


def test_the_ring_keeps_the_last_operations_and_dumps_them(tmp_path):
    class Comm:
        size = 2

    flight.clear()
    comm = Comm()
    for _ in range(flight.RING + 5):
        with flight.Op(comm, "allreduce", 8):
            pass
    record = flight.post(comm, "send", 16, peer=1)
    flight.waiting(record)
    flight.dump_to(str(tmp_path), 3)
    try:
        path = flight.dump("a test")
    finally:
        flight.dump_to(None, 0)
        flight.done(record)
    doc = json.loads(open(path).read())
    assert path.endswith("flight-rank3.json") and doc["reason"] == "a test"
    assert len(doc["operations"]) == flight.RING
    assert doc["operations"][-1]["seq"] == flight.RING + 6
    assert doc["waiting_in"]["op"] == "send" and doc["waiting_in"]["end"] is None


@pytest.mark.mpi
def test_a_stopped_rank_is_named_with_its_operation_and_the_dumps(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    args = [*ARGS, "--epochs", "100000", "--comm", "mpi-host", "--metrics", str(metrics)]
    job = Job([*args, "--stall-warn", "1", "--stall-abort", "3"])
    try:
        job.wait_for_line("epoch 2/")
        os.kill(job.ranks(2)[1], signal.SIGSTOP)
        code, err, _ = job.finish(30)
    finally:
        job.kill()
    assert code == 124, err
    (line,) = [line for line in err.splitlines() if line.startswith("xpnn: stalled:")]
    assert "rank 1 never entered " in line and "; rank 0 waits in it;" in line, line
    assert f"flight records in {tmp_path}/flight-rank*.json" in line, line
    dump = json.loads((tmp_path / "flight-rank0.json").read_text())
    assert dump["waiting_in"]["end"] is None and dump["operations"]
    time.sleep(0.1)
    out = cli_trace(tmp_path)  # a directory of flight records alone merges too
    merged = _trace(tmp_path / "merged.json")
    assert "merged" in out and any(e.get("cat") == "flight" for e in merged)


@pytest.mark.mpi
def test_a_failing_rank_dumps_its_flight_record(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    args = [*ARGS, "--comm", "mpi-host", "--metrics", str(metrics)]
    proc = run_xpnn(args, ranks=2, env={"XPNN_FAIL_AT": "1:3"})
    assert proc.returncode == 1, proc.stderr
    dump = json.loads((tmp_path / "flight-rank1.json").read_text())
    assert dump["reason"].startswith("failed: ") and "injected failure" in dump["reason"]
    assert dump["operations"][-1]["step"] == 2  # its last operations, of the step before


def test_a_wait_for_a_silent_peer_names_both():
    where = {"group": "2 ranks", "seq": 2599, "op": "receive", "nbytes": 12800, "peer": 1}
    where |= {"bucket": None, "microbatch": 3, "step": 305}
    assert flight.describe({0: where}, [1], None) == (
        "rank 0 waits in receive #2599 from rank 1 (12.5 KiB, micro-batch 3, step 305); "
        "rank 1 did not answer"
    )
