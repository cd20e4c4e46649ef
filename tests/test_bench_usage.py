"""Every benchmark refuses a bad argument before it measures anything: exit 2, one line
naming the flag, no traceback (as the xpnn command does)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, run_locked_out, run_with_stdout_closed


@pytest.mark.parametrize(
    ("script", "args", "needle"),
    [
        ("matmul_crossover", ["--min-n", "0"], "--min-n: must be >= 1"),
        ("matmul_crossover", ["--min-n", "512", "--max-n", "64"], "--min-n 512 is above --max-n"),
        ("matmul_crossover", ["--threads", "0"], "--threads: must be >= 1"),
        ("matmul_crossover", ["--repeats", "0"], "--repeats: must be >= 1"),
        ("matmul_crossover", ["--warmup", "-1"], "--warmup: must be >= 0"),
        ("matmul_crossover", ["--shapes", "2x2"], "--shapes: bad shape '2x2'"),
        ("matmul_crossover", ["--plot", "/tmp/x.foo"], "matplotlib cannot write '.foo'"),
        ("scaling", ["--plot", "/tmp/scaling"], "--plot: /tmp/scaling: matplotlib cannot write"),
        ("allreduce", ["--iters", "0"], "--iters: must be >= 1"),
        ("allreduce", ["--max-size", "2"], "--max-size: must be a multiple of 4 bytes"),
        # 10 B sent 2 float32 values (8 B) and its bandwidth counted 10
        ("allreduce", ["--max-size", "10"], "--max-size: must be a multiple of 4 bytes"),
        ("optimizer_step", ["--params", "0"], "--params: must be >= 1"),
        ("scaling", ["--ranks", "0"], "--ranks"),
        ("throughput", ["--steps", "0"], "--steps: must be >= 1"),
        ("staging", ["--sizes", "4,-1"], "--sizes"),
        ("pipeline_memory", ["--stages", "1"], "--stages"),
        # a free-form choice: refused before the header, not a UserError after it
        ("allreduce", ["--comm", "bogus", "--max-size", "1K"], "--comm: invalid choice: 'bogus'"),
        # output places are checked before measuring, not written to after it
        (
            "allreduce",
            ["--json", "/nonexistent/x.json", "--max-size", "1K"],
            "--json /nonexistent/x.json: directory /nonexistent does not exist",
        ),
        ("allreduce", ["--json", "bench"], "--json bench: is a directory; give a file name"),
        ("optimizer_step", ["--json", "/proc/x.json"], "--json /proc/x.json: cannot create files"),
        ("matmul_crossover", ["--out", "/proc/mc"], "--out /proc/mc: cannot be made"),
        ("matmul_crossover", ["--out", "README.md"], "--out README.md: exists and is not a dir"),
        ("matmul_crossover", ["--csv", "/nonexistent/m.csv"], "--csv /nonexistent/m.csv: direc"),
        ("throughput", ["--json", "/proc/t.json"], "--json /proc/t.json: cannot create files"),
        ("scaling", ["--out", "/proc/s"], "--out /proc/s: cannot be made"),
        ("scaling", ["--plot", "/nonexistent/s.png"], "--plot /nonexistent/s.png: directory"),
        ("pipeline_memory", ["--out", "/proc/pm"], "--out /proc/pm: cannot be made"),
        # comma lists of known names, at least one
        ("optimizer_step", ["--sides", "numpy,bogus"], "--sides: unknown 'bogus'"),
        ("optimizer_step", ["--sides", ""], "--sides: empty"),
        ("throughput", ["--backends", ","], "--backends: empty"),
        # counts and durations: non-negative, finite
        ("scaling", ["--retries", "-1"], "--retries: must be >= 0"),
        ("throughput", ["--retries", "-1"], "--retries: must be >= 0"),
        ("throughput", ["--gap", "-1"], "--gap: must be >= 0"),
        ("throughput", ["--gap", "nan"], "--gap: must be a finite number"),
        ("scaling", ["--quiet-timeout", "nan"], "--quiet-timeout: must be a finite number"),
        ("matmul_crossover", ["--cpu-budget", "nan"], "--cpu-budget: must be a finite number"),
        ("matmul_crossover", ["--cpu-budget", "inf"], "--cpu-budget: must be a finite number"),
        ("matmul_crossover", ["--cpu-budget", "-1"], "--cpu-budget: must be >= 0"),
        # the mpiexec to run is found now, not when the first run starts
        ("scaling", ["--mpiexec", "/nonexistent"], "--mpiexec: /nonexistent does not exist"),
        ("pipeline_memory", ["--mpiexec", "/nonexistent"], "--mpiexec: /nonexistent does not"),
        ("scaling", ["--mpiexec", "./README.md"], "--mpiexec: ./README.md is not an executable"),
        ("scaling", ["--mpiexec", "no-such-mpiexec"], "--mpiexec: 'no-such-mpiexec' is not on"),
        # xpnn's own rule for --seed (an integer >= 0), applied before any run
        ("scaling", ["--seed", "-1"], "--seed: must be >= 0"),
        ("pipeline_memory", ["--seed", "-1"], "--seed: must be >= 0"),
        ("throughput", ["--seed", "-1"], "--seed: must be >= 0"),
        ("matmul_crossover", ["--seed", "-1"], "--seed: must be >= 0"),
        # within_job: each side's xpnn arguments are checked as xpnn checks them
        ("within_job", ["--a", "--epochs x"], "--a: --epochs: not an integer: 'x'"),
        ("within_job", ["--b", "'unclosed"], "--b: No closing quotation"),
        ("within_job", ["--rounds", "0"], "--rounds: must be >= 1"),
        ("within_job", ["--a", "--seed 1", "--b", "--seed 1"], "nothing to compare"),
        ("within_job", ["--json", "/proc/w.json"], "--json /proc/w.json: cannot create files"),
        ("within_job", ["--a", "--dataset mnist --data-dir /nonexistent"], "no such directory"),
        ("gemm_split", ["--batch", "1", "--ranks", "2"], "--batch 1 is below --ranks 2"),
        ("gemm_split", ["--hidden", "0"], "--hidden: expected positive integers"),
        ("gemm_split", ["--seconds", "nan"], "--seconds: must be a finite number"),
        ("core_contention", ["--cpus", "0,4096"], "--cpus: 4096 is not a CPU this process may"),
        ("core_contention", ["--cpus", "0"], "--cpus: needs two or more CPUs to compare"),
        ("core_contention", ["--cpus", "a"], "--cpus: expected CPU numbers like 0,1"),
        ("core_contention", ["--gemm", "2,3"], "--gemm: expected M,K,N"),
        ("core_contention", ["--stream-mib", "0"], "--stream-mib: must be > 0"),
        ("core_contention", ["--kernels", "fma,x"], "--kernels: unknown 'x'"),
        ("core_contention", ["--json", "/proc/c.json"], "--json /proc/c.json: cannot create files"),
        ("core_contention", ["--gemm", "1,100000,100000"], "--gemm: 37.3 GiB a process"),
        ("core_contention", ["--stream-mib", "1e9"], "--stream-mib: 976562.5 GiB a process"),
        # xpnn's own refusals, made before the first run rather than by it (before the 18th
        # session: mpiexec started, then "run failed (exit 2): <command>" and exit 1)
        (
            "pipeline_memory",
            ["--model", "mlp", "--hidden", "32,32", "--stages", "5"],
            "--stages 5: --parallel pipeline: 5 stages (a replica's ranks) but the model has only",
        ),
        (
            "scaling",
            ["--parallel", "pipeline", "--mode", "strong", "--hidden", "8", "--ranks", "2,3"],
            "--ranks 3: --parallel pipeline: 3 stages (a replica's ranks) but the model has only 2",
        ),
        (
            "scaling",
            ["--dataset", "fashion-mnist", "--data-dir", "bench/no-such-dir"],
            "--data-dir bench/no-such-dir: no such directory",
        ),
        ("scaling", ["--dataset", "mnist", "--data-dir", "bench"], "--data-dir bench: missing"),
        (
            "pipeline_memory",
            ["--dataset", "fashion-mnist", "--data-dir", "bench/no-such-dir"],
            "--data-dir bench/no-such-dir: no such directory",
        ),
        # the first epoch is not timed: one epoch would time nothing (or, before, itself)
        ("scaling", ["--epochs", "1"], "--epochs: must be >= 2, got 1: the first epoch includes"),
        ("pipeline_memory", ["--epochs", "1"], "--epochs: must be >= 2, got 1: the first epoch"),
        (
            "throughput",
            ["--ranks-compare", "--ranks-epochs", "1"],
            "--ranks-epochs: must be >= 2, got 1: the first epoch includes compilation",
        ),
        # a list value given twice is a slip, not a second measurement
        ("core_contention", ["--kernels", "fma,fma"], "--kernels: 'fma' given twice"),
        ("optimizer_step", ["--sides", "numpy,numpy"], "--sides: 'numpy' given twice"),
        ("throughput", ["--backends", "numpy,numba,numpy"], "--backends: 'numpy' given twice"),
        ("throughput", ["--batches", "32,32"], "--batches: 32 given twice in '32,32'"),
        ("scaling", ["--ranks", "2,2"], "--ranks: 2 given twice in '2,2'"),
        ("staging", ["--sizes", "4,4"], "--sizes: 4 given twice in '4,4'"),
        ("matmul_crossover", ["--shapes", "2x3x4,2x3x4"], "--shapes: shape '2x3x4' given twice"),
        # an empty path is a slip (--json $UNSET), not the current folder
        ("allreduce", ["--json", ""], "--json: empty path"),
        ("scaling", ["--json", ""], "--json: empty path"),
        ("core_contention", ["--json", ""], "--json: empty path"),
        ("optimizer_step", ["--json", ""], "--json: empty path"),
        ("throughput", ["--json", ""], "--json: empty path"),
        ("within_job", ["--json", ""], "--json: empty path"),
        ("matmul_crossover", ["--json", ""], "--json: empty path"),
        ("matmul_crossover", ["--csv", ""], "--csv: empty path"),
        ("matmul_crossover", ["--out", ""], "--out: empty path"),
        ("matmul_crossover", ["--plot", ""], "--plot: empty path"),
        ("scaling", ["--out", ""], "--out: empty path"),
        ("scaling", ["--mpiexec", ""], "--mpiexec: empty path"),
        ("scaling", ["--data-dir", ""], "--data-dir: empty path"),
        ("pipeline_memory", ["--out", ""], "--out: empty path"),
        # within_job times training steps only: xpnn flags it would ignore are refused
        ("within_job", ["--a", "--epochs 3"], "--a: --epochs: not used here, --rounds sets"),
        ("within_job", ["--b", "--save /tmp/w.npz"], "--b: --save: not used here"),
        ("within_job", ["--a", "--metrics /tmp/w.jsonl"], "--a: --metrics: not used here"),
        ("within_job", ["--b", "--checkpoint-dir /tmp/w"], "--b: --checkpoint-dir: not used"),
        ("within_job", ["--a", "--resume"], "--a: --resume: not used here"),
        ("within_job", ["--a", "--seed 1", "--", "--epochs", "3"], "--epochs (after --): not"),
        # a side's one word starting with -- is its value, not a flag of within_job's own
        # (before the 18th session: "argument --b: expected one argument")
        ("within_job", ["--a", "--optimizer sgd", "--b", "--resume"], "--b: --resume: not used"),
    ],
)
def test_a_bad_argument_is_a_one_line_usage_error(script, args, needle):
    path = ROOT / "bench" / f"{script}.py"
    proc = subprocess.run(
        [sys.executable, str(path), *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    # one line: no argparse usage block before it (before the 18th session there was one)
    (line,) = proc.stderr.strip().splitlines()
    assert line.removeprefix("bench/").startswith(f"{script}.py: error: "), line
    assert needle in line, proc.stderr
    assert proc.stdout == ""  # nothing measured, nothing reported


@pytest.mark.parametrize(
    ("script", "args"), [("scaling", ["--ranks", "0"]), ("matmul_crossover", ["--min-n", "0"])]
)
def test_a_usage_error_needs_no_installed_xpnn(tmp_path, script, args):
    """``python3 bench/scaling.py`` from a Python without xpnn installed (the system one, next
    to a venv) died in the usage error itself: ModuleNotFoundError, from asking xpnn which
    rank prints. The scripts now use the checkout's xpnn (here, an installed one that fails
    to import stands first on the path)."""
    fake = tmp_path / "not-installed" / "xpnn"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('xpnn is not installed')\n")
    env = {**os.environ, "PYTHONPATH": str(fake.parent)}
    cmd = [sys.executable, str(ROOT / "bench" / f"{script}.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.removeprefix("bench/").startswith(f"{script}.py: error: {args[0]}"), line


@pytest.mark.parametrize(
    ("script", "flag", "name"),
    [
        ("scaling", "--out", "o"),
        ("scaling", "--mpiexec", "mpiexec"),
        ("matmul_crossover", "--out", "o"),
        ("pipeline_memory", "--out", "o"),
        ("allreduce", "--json", "x.json"),
        ("optimizer_step", "--json", "x.json"),
        ("throughput", "--json", "x.json"),
        ("within_job", "--json", "x.json"),
        ("core_contention", "--json", "x.json"),
    ],
)
def test_a_path_this_user_may_not_look_at(tmp_path, script, flag, name):
    """Under a directory the user may not enter even ``stat()`` fails (before the 17th
    session: a PermissionError traceback)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    path = locked / name
    proc = run_locked_out([f"bench/{script}.py", flag, str(path)], locked, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{flag}" in proc.stderr and f"{path}: Permission denied" in proc.stderr, proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize(
    ("script", "args"),
    [
        ("gemm_split", ["--samples", "2", "--seconds", "0"]),
        ("core_contention", ["--kernels", "fma", "--rounds", "1", "--seconds", "0"]),
        ("allreduce", ["--max-size", "1K", "--iters", "2"]),
        ("matmul_crossover", ["--max-n", "64", "--repeats", "2", "--shapes", "small"]),
    ],
)
def test_stdout_closed_by_its_reader_stops_in_one_line(tmp_path, script, args):
    """``python bench/X.py | head -1``: as ``python -m xpnn`` there, one line and exit 141
    (before the 17th session, a BrokenPipeError traceback)."""
    if script == "matmul_crossover":
        args = [*args, "--out", str(tmp_path)]
    code, err = run_with_stdout_closed([f"bench/{script}.py", *args])
    assert code == 141, err
    assert err.splitlines()[-1] == f"{script}.py: stdout was closed (broken pipe): stopped", err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("script", "args", "files"),
    [
        (
            "matmul_crossover",
            ["--max-n", "32", "--repeats", "1", "--shapes", "small"],
            {"matmul_crossover.csv", "matmul_crossover.json"},
        ),
        (
            "scaling",
            [
                "--ranks",
                "1",
                "--repeats",
                "1",
                "--dataset",
                "synthetic",
                "--synthetic-size",
                "256",
                "--epochs",
                "2",
                "--hidden",
                "8",
            ],
            {"scaling.json"},
        ),
    ],
)
def test_without_matplotlib_the_results_are_still_written(tmp_path, script, args, files):
    """matplotlib is the ``plot`` extra, not a dependency: without it (here an importable
    ``matplotlib`` that fails, first on the path), the default plot is left out with a note
    before measuring, and an explicit ``--plot`` is refused. Before the 17th session both
    measured first and then died of ModuleNotFoundError."""
    fake = tmp_path / "no-matplotlib" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('matplotlib is not installed')\n")
    env = {**os.environ, "PYTHONPATH": f"{fake.parent}{os.pathsep}{ROOT}"}
    out = tmp_path / "out"
    cmd = [sys.executable, f"bench/{script}.py", *args, "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"{script}.py: matplotlib is not installed: no plot" in proc.stderr.splitlines()[0]
    assert {p.name for p in out.iterdir()} == files
    asked = subprocess.run(
        [*cmd, "--plot", str(tmp_path / "p.png")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=env,
    )
    assert asked.returncode == 2 and asked.stdout == "", asked.stderr
    assert asked.stderr.splitlines()[-1].endswith(
        "--plot: needs matplotlib (pip install 'xpnn[plot]')"
    )


def test_ctrl_c_in_a_benchmark_is_one_line(tmp_path):
    """SIGINT while ``scaling.py`` waits for the run it times: ``scaling.py: interrupted``,
    exit 130 (before the 17th session, a KeyboardInterrupt traceback)."""
    args = ["--ranks", "1", "--repeats", "1", "--dataset", "synthetic", "--synthetic-size"]
    args += ["20000", "--epochs", "200", "--hidden", "64", "--out", str(tmp_path)]
    args += ["--max-foreign", "99"]  # a busy machine must not make it wait or redo the run
    proc = subprocess.Popen(
        [sys.executable, "bench/scaling.py", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal would
    )
    try:
        line = "-"
        while line and not line.startswith("scaling: "):  # after a note on a busy machine
            line = proc.stdout.readline()
        assert line, proc.stderr.read()  # it ended before it started the timed run
        time.sleep(1.0)  # the timed run has started
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == "scaling.py: interrupted" and "Traceback" not in err, err


def test_the_plot_suffixes_are_ones_matplotlib_writes():
    """The list is kept by hand (checking a path must not import matplotlib before measuring)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from _common import PLOT_SUFFIXES
    from matplotlib.backend_bases import FigureCanvasBase

    assert set(PLOT_SUFFIXES) <= set(FigureCanvasBase.get_supported_filetypes())


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("script", "args", "needle"),
    [
        ("allreduce", ["--bogus"], "allreduce.py: error: unrecognized arguments: --bogus"),
        ("within_job", ["--bogus"], "within_job.py: error: unrecognized arguments: --bogus"),
        ("within_job", ["--a", "--resume"], "within_job.py: error: --a: --resume: not used"),
    ],
)
def test_under_mpiexec_rank_0_alone_prints_a_usage_error(script, args, needle):
    """Every rank parses the same flags: one line, not one per rank (before the 18th session,
    usage and error twice on 2 ranks)."""
    from conftest import mpiexec_path

    cmd = [mpiexec_path(), "-n", "2", sys.executable, f"bench/{script}.py", *args]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()], proc.stderr  # one line
    assert needle in proc.stderr and proc.stdout == ""


HELP_SCRIPTS = [
    "allreduce", "core_contention", "gemm_split", "matmul_crossover", "optimizer_step",
    "pipeline_memory", "scaling", "staging", "step_phases", "throughput", "within_job",
]  # fmt: skip


@pytest.mark.parametrize("script", HELP_SCRIPTS)
def test_help_shows_each_default_once_as_the_flag_takes_it(script):
    """No "(default: all allowed) (default: None)", no Python list (``[1, 2]``) where the flag
    takes ``1,2``, and the script's own name (step_phases.py showed xpnn's help before the 18th
    session)."""
    proc = subprocess.run(
        [sys.executable, f"bench/{script}.py", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    text = " ".join(proc.stdout.split())  # help wraps lines anywhere
    assert proc.stdout.startswith("usage: ") and f"{script}.py" in proc.stdout.splitlines()[0]
    assert "python -m xpnn [train]" not in text
    assert "(default: None)" not in text
    assert not re.search(r"default:? \[", text), text
    assert not re.search(r"\(default[^)]*\) \(default", text), text
