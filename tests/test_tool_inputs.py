"""Every tool fails cleanly: random bytes as files and random text as flag values given to
``xpnn``, ``xpnn plot`` and ``python -m bench`` end in success or in one line on stderr and
exit 2, never a traceback. In the process (a subprocess per example would take minutes): an
exception escaping ``main`` fails the test as a traceback would. The example counts keep the
file to seconds on a 2-core CI machine."""

from __future__ import annotations

import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import benchmarks
from bench.__main__ import main as bench_main
from xpnn.checkpoint import DamagedCheckpoint, read_npz
from xpnn.errors import UserError
from xpnn.flags import ArgError, build_parser
from xpnn.plot import main as plot_main
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
