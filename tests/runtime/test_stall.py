"""A rank that stops answering: the others wait without burning a core, say where they wait
after ``--stall-warn`` seconds, and end the job after ``--stall-abort`` seconds (exit 124),
naming the ranks that waited and the one they waited for. Real ``mpiexec -n 2`` runs with a
rank stopped by SIGSTOP or held up by an injected sleep, and the waiting loop on its own."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import TINY_FLOAT64_RUN, assert_one_line_user_error, run_xpnn
from faults import Job, cpu_seconds, record

from xpnn.runtime import stall

ARGS = [*TINY_FLOAT64_RUN, "--hidden", "16"]


class _Later:
    """A request that completes ``seconds`` after it was made."""

    def __init__(self, seconds: float) -> None:
        self.made_at = time.perf_counter()
        self.done_at = self.made_at + seconds
        self.tests = 0
        self.tests_after_yielding = 0

    def Test(self) -> bool:  # noqa: N802 - mpi4py's name
        now = time.perf_counter()
        self.tests += 1
        self.tests_after_yielding += now - self.made_at > stall.YIELD_S + 0.01
        return now >= self.done_at


@pytest.fixture
def limits():
    before = stall.limits()
    yield stall.set_limits
    stall.set_limits(*before)


def test_a_long_wait_sleeps_instead_of_spinning(limits):
    limits(0, 0)
    cpu, request = time.process_time(), _Later(1.5)
    stall.wait(request, "a test")
    # from the request's own start: a loaded machine may pause between it and a later clock
    waited, used = time.perf_counter() - request.made_at, time.process_time() - cpu
    assert 1.5 <= waited < 1.6  # ends at most a nap late
    assert used < 0.5 * waited, used  # spinning would use the whole 1.5 s
    # after the first YIELD_S, at most one poll a nap
    assert request.tests_after_yielding < 1.5 / stall.MIN_NAP_S, request.tests_after_yielding


def test_an_exchange_under_way_is_polled_without_naps(limits, monkeypatch):
    """MPI moves a large message only while it is polled: a nap between polls would stretch
    an allreduce of MiBs (Open MPI 4.1, 4 MiB: 30 ms polled with naps, 1.9 ms without)."""
    limits(0, 0)
    naps = []
    monkeypatch.setattr(stall.time, "sleep", naps.append)
    request = _Later(stall.YIELD_S / 2)
    stall.wait(request, "a test")
    assert naps == []
    assert request.tests > 100  # polled all along, not once at the end


def test_a_short_wait_ends_at_once(limits):
    limits(0, 0)
    request = _Later(0.002)
    start = time.perf_counter()
    stall.wait(request, "a test")
    # naps of 50 us, or what a loaded scheduler makes of them: far from YIELD_S's 0.25 s
    assert time.perf_counter() - start < 0.1


def test_the_warning_is_said_once_per_wait_with_the_step_and_bucket(limits, capfd):
    limits(0.05, 0)
    stall.at_step(41)
    stall.in_bucket(1, 3)
    stall.wait(_Later(0.3), "an allreduce")
    lines = capfd.readouterr().err.splitlines()
    assert lines == [
        "xpnn: has waited 0.05 s for the others in an allreduce (training step 41, gradient "
        "bucket 2 of 3)"
    ]
    stall.in_phase("setup")


def test_the_stall_line_names_who_waited_and_for_whom():
    line = stall.stall_line([0, 2, 3], [1], 600, "rank 0 in an allreduce, training step 9")
    assert line == (
        "xpnn: stalled: ranks 0, 2, 3 waited 600 s for rank 1 (rank 0 in an allreduce, "
        "training step 9); ending the job"
    )


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "5"])
def test_limits_must_be_seconds(value):
    with pytest.raises(ValueError, match="stall_warn: must be a finite number of seconds"):
        stall.set_limits(stall_warn=value)


@pytest.mark.parametrize("flag", ["--stall-warn", "--stall-abort"])
@pytest.mark.parametrize("value", ["-1", "nan", "soon"])
def test_a_bad_limit_names_its_flag(flag, value):
    assert_one_line_user_error(run_xpnn([*ARGS, flag, value]), f"{flag}: ")


@pytest.mark.mpi
def test_a_stopped_rank_ends_the_job_and_its_peer_does_not_spin():
    job = Job([*ARGS, "--epochs", "100000", "--stall-warn", "1", "--stall-abort", "4"])
    try:
        job.wait_for_line("epoch 2/")
        ranks = job.ranks(2)
        os.kill(ranks[1], signal.SIGSTOP)
        time.sleep(1.5)  # past the naps' growth: now rank 0 waits the long way
        cpu, start = cpu_seconds(ranks[0]), time.monotonic()
        time.sleep(1.5)
        used = cpu_seconds(ranks[0]) - cpu
        waited = time.monotonic() - start
        code, err, _ = job.finish(30)
    finally:
        job.kill()
    record(
        test="stall-cpu",
        cpu_s=round(used, 3),
        waited_s=round(waited, 2),
        exit=code,
        stderr=err.splitlines(),
    )
    assert used < 0.3 * waited, f"rank 0 used {used:.2f} s of CPU in {waited:.2f} s of waiting"
    assert code == stall.STALL_EXIT, err
    warned = [line for line in err.splitlines() if line.startswith("rank 0: has waited 1 s")]
    assert len(warned) == 1, err
    said = [line for line in err.splitlines() if line.startswith("xpnn: stalled:")]
    assert len(said) == 1 and "rank 0 waited 4 s for rank 1 (rank 0 in " in said[0], err


@pytest.mark.mpi
@pytest.mark.parametrize("warn, warnings", [("1", 1), ("0", 0)])
def test_a_rank_held_up_is_waited_for_with_one_warning(warn, warnings):
    """Rank 1 sleeps 2.5 s before step 3: rank 0 says once where it waits; the run ends well."""
    proc = run_xpnn(
        [*ARGS, "--stall-warn", warn, "--stall-abort", "20"],
        ranks=2,
        timeout=120,
        env={"XPNN_SLEEP_AT": "1:3:2.5"},
    )
    assert proc.returncode == 0, proc.stderr
    said = [line for line in proc.stderr.splitlines() if "has waited" in line]
    assert len(said) == warnings, proc.stderr
    if warnings:
        assert said[0].startswith("rank 0: has waited 1 s for the others in ")
        assert "training step 3" in said[0]


def test_the_injected_pause_is_a_callback_read_once_at_start_up(monkeypatch):
    """``XPNN_SLEEP_AT`` is read when the run's callbacks are made, not at every step: unset,
    no step callback exists; set, its pause sleeps that rank before that step alone."""
    from xpnn.errors import UserError
    from xpnn.train.callbacks import PauseInjection, run_callbacks

    monkeypatch.delenv("XPNN_SLEEP_AT", raising=False)
    assert not any(isinstance(c, PauseInjection) for c in run_callbacks(print, True))
    monkeypatch.setenv("XPNN_SLEEP_AT", "1:3:0.25")
    pause = next(c for c in run_callbacks(print, True) if isinstance(c, PauseInjection))
    monkeypatch.setenv("XPNN_SLEEP_AT", "0:0:100")  # read no more
    trainer = type("T", (), {"comm": type("C", (), {"rank": 1})()})()
    start = time.perf_counter()
    pause.on_step_begin(trainer, 2)
    assert time.perf_counter() - start < 0.2
    pause.on_step_begin(trainer, 3)
    assert time.perf_counter() - start >= 0.25
    monkeypatch.setenv("XPNN_SLEEP_AT", "1:x")
    with pytest.raises(UserError, match="XPNN_SLEEP_AT=1:x: expected RANK:STEP:SECONDS"):
        run_callbacks(print, True)
