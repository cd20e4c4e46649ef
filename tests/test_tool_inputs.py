"""Every tool fails cleanly: random bytes as files and random text as flag values given to
``xpnn``, ``xpnn plot`` and ``python -m bench`` end in success or in one line on stderr and
exit 2, never a traceback. Many examples in the process (an exception escaping ``main``
fails the test as a traceback would), and a few through the real commands, each a
subprocess as a user runs it. The example counts keep the file to seconds on a 2-core CI
machine."""

from __future__ import annotations

import os
import string
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import benchmarks
from bench.__main__ import main as bench_main
from xpnn.commands.flags import ArgError, build_parser
from xpnn.errors import UserError
from xpnn.record.plot import main as plot_main
from xpnn.train.checkpoint import DamagedCheckpoint, read_npz
from xpnn.train.metrics_file import check_metrics_file

FEW = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
TEXT = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["nan", "inf", "-inf", "1e308", "-1", "0", "1e-320", "99999999999999"]),
    st.integers().map(str),
    st.floats().map(repr),
    st.text(string.digits + ",.-e", max_size=20),
)
FLAGS = [a.option_strings[-1] for a in build_parser()._actions if a.option_strings]
FLAGS.remove("--help")
BENCH = [n for n in benchmarks.NAMES if not getattr(benchmarks.load(n), "PASSTHROUGH", False)]
BENCH_FLAGS = {  # every flag of every benchmark that takes a value
    name: [
        a.option_strings[-1]
        for a in benchmarks._parser(benchmarks.load(name), name)._actions
        if a.option_strings and a.nargs != 0 and a.dest not in ("help", "source")
    ]
    for name in BENCH
}


def _one_line_or_nothing(err: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) <= 1, err
    assert "Traceback" not in err


@FEW
@given(flag=st.sampled_from(FLAGS), value=TEXT)
def test_every_flag_takes_any_value_or_names_itself(flag, value):
    """A value is parsed or refused in one line naming the flag, never an exception."""
    try:
        build_parser().parse_args([flag, value])
    except ArgError as exc:
        assert "\n" not in str(exc)
        assert flag in str(exc) or "unrecognized" in str(exc) or "expected" in str(exc)


@FEW
@given(data=st.binary(max_size=400))
def test_random_bytes_are_refused_as_a_metrics_file_or_a_checkpoint(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("bytes") / "file"
    path.write_bytes(data)
    try:
        check_metrics_file(path)
    except UserError as exc:
        assert "\n" not in str(exc)
    with pytest.raises(DamagedCheckpoint):
        read_npz(path)


@FEW
@given(
    data=st.one_of(
        st.binary(max_size=300),
        st.lists(
            st.dictionaries(
                st.sampled_from(["event", "epoch", "train_loss", "test_acc", "samples_per_s"]),
                st.one_of(st.just("epoch"), st.integers(), st.floats(), st.lists(st.none())),
            ),
            max_size=4,
        ).map(lambda rs: "\n".join(map(_json, rs)).encode()),
    ),
    out=st.sampled_from(["o.png", "o.PNG", "o", "o.xyz", "in.jsonl", "."]),
)
def test_plot_takes_any_file_and_output_name(tmp_path_factory, capsys, data, out):
    folder = tmp_path_factory.mktemp("plot")
    (folder / "in.jsonl").write_bytes(data)
    code = plot_main([str(folder / "in.jsonl"), "-o", str(folder / out)])
    err = capsys.readouterr().err
    assert code in (0, 2)
    _one_line_or_nothing(err)
    if code == 0:
        assert (folder / out).is_file()


@FEW
@given(pick=st.data(), value=TEXT, data=st.binary(max_size=200))
def test_bench_takes_any_flag_value_and_records_file(tmp_path_factory, capsys, pick, value, data):
    """With ``--from`` nothing is measured: the flags are checked and the file read."""
    name = pick.draw(st.sampled_from(BENCH))
    flag = pick.draw(st.sampled_from(BENCH_FLAGS[name]))
    records = tmp_path_factory.mktemp("bench") / "records.jsonl"
    records.write_bytes(data)
    try:
        code = bench_main([name, flag, value, "--from", str(records)])
    except SystemExit as exc:  # argparse's --help and the like
        code = exc.code
    err = capsys.readouterr().err
    assert code in (0, 2), err
    _one_line_or_nothing(err)


def _json(record: dict) -> str:
    import json

    return json.dumps(record)


def test_a_path_printed_is_the_path_written(tmp_path, capsys):
    """``-o`` without .png is refused rather than written under another name."""
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"event": "epoch", "epoch": 1, "train_loss": 1.0}\n')
    assert plot_main([str(metrics), "-o", str(tmp_path / "noext")]) == 2
    assert not Path(f"{tmp_path / 'noext'}.png").exists()
    assert "-o" in capsys.readouterr().err


# ------------------------------------------------------------ the real commands, as processes

COMMAND = settings(  # a process costs about a second: a handful, the same ones on every run
    max_examples=4,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
TINY = ["--dataset", "synthetic", "--synthetic-size", "40", "--epochs", "1", "--batch-size",
        "20", "--hidden", "4", "--threads", "1", "--no-progress", "--backend", "numpy"]  # fmt: skip
PATH_FLAGS = {"--data-dir", "--metrics", "--save", "--checkpoint-dir", "--trace"}
VALUE_FLAGS = [f for f in FLAGS if f not in PATH_FLAGS]  # paths get files of random bytes below
STILL_RUNNING_S = 4.0  # a value refused is said within a second; a run still going took it


def _command(args: list[str], cwd: Path) -> tuple[int | None, str]:
    """(exit code, stderr) of ``python ARGS`` in ``cwd``; None: still running after
    ``STILL_RUNNING_S`` (a value taken, training under way), then ended."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=STILL_RUNNING_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        return None, err
    return proc.returncode, err


def _ends_cleanly(code: int | None, err: str) -> None:
    """Success (or still running), or one line and exit 2; never a traceback."""
    assert "Traceback" not in err, err
    assert code in (None, 0, 2), err
    if code == 2:
        assert len([line for line in err.splitlines() if line.strip()]) == 1, err


@COMMAND
@given(flag=st.sampled_from(VALUE_FLAGS), value=TEXT)
def test_python_m_xpnn_takes_any_flag_value(tmp_path_factory, flag, value):
    folder = tmp_path_factory.mktemp("xpnn")
    _ends_cleanly(*_command(["-m", "xpnn", *TINY, flag, value], folder))


@COMMAND
@given(role=st.sampled_from(["metrics", "checkpoint", "data"]), data=st.binary(max_size=300))
def test_python_m_xpnn_takes_any_file(tmp_path_factory, role, data):
    """Random bytes as the metrics file, as the checkpoint to resume, as MNIST's files."""
    folder = tmp_path_factory.mktemp("xpnn")
    if role == "metrics":
        (folder / "m.jsonl").write_bytes(data)
        extra = ["--metrics", "m.jsonl"]
    elif role == "checkpoint":
        (folder / "ck").mkdir()
        (folder / "ck" / "checkpoint-epoch0001.npz").write_bytes(data)
        extra = ["--checkpoint-dir", "ck", "--resume", "--epochs", "2"]
    else:
        (folder / "mnist").mkdir()
        for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
                     "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):  # fmt: skip
            (folder / "mnist" / name).write_bytes(data)
        extra = ["--dataset", "mnist", "--data-dir", "mnist"]
    _ends_cleanly(*_command(["-m", "xpnn", *TINY, *extra], folder))


@COMMAND
@given(data=st.binary(max_size=300), out=st.sampled_from(["o.png", "o", "o.xyz", "in.jsonl"]))
def test_python_m_xpnn_plot_takes_any_file(tmp_path_factory, data, out):
    folder = tmp_path_factory.mktemp("plot")
    (folder / "in.jsonl").write_bytes(data)
    code, err = _command(["-m", "xpnn", "plot", "in.jsonl", "-o", out], folder)
    _ends_cleanly(code, err)
    if code == 0:
        assert (folder / out).is_file()


@settings(COMMAND, max_examples=6)  # the benchmarks' start-up is short: no NumPy to load
@given(pick=st.data(), value=TEXT, data=st.binary(max_size=200))
def test_python_m_bench_takes_any_flag_value_and_records_file(tmp_path_factory, pick, value, data):
    name = pick.draw(st.sampled_from(BENCH))
    flag = pick.draw(st.sampled_from(BENCH_FLAGS[name]))
    folder = tmp_path_factory.mktemp("bench")
    (folder / "records.jsonl").write_bytes(data)
    code, err = _command(["-m", "bench", name, flag, value, "--from", "records.jsonl"], folder)
    _ends_cleanly(code, err)
