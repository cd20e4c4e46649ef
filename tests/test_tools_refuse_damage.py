"""The tools on damaged or hostile inputs: ``xpnn generate`` on hand-edited checkpoints (wrong
shapes, a missing parameter, integer, complex or NaN weights, a damaged ``meta.identity``) and
on hostile flag values, ``xpnn trace`` on malformed rank files and output paths: one line on
stderr and exit 2, as ``--resume`` refuses the same files, never a traceback. Most cases run
in the process (an exception escaping ``main`` fails the test as a traceback would); one
checkpoint is trained through the real command."""

from __future__ import annotations

import json
import math
import string
from pathlib import Path

import numpy as np
import pytest
from conftest import run_xpnn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xpnn.commands import generate
from xpnn.commands.generate import main as generate_main
from xpnn.train.checkpoint import atomic_savez, latest_checkpoint, read_npz

FEW = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
CORPUS = "to be or not to be, that is the question\n" * 20


@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory) -> Path:
    """A whole checkpoint of a small GPT, trained through the real command."""
    root = tmp_path_factory.mktemp("gpt")
    (root / "t.txt").write_text(CORPUS)
    args = ["--model", "gpt", "--dataset", "text", "--data-dir", str(root / "t.txt"),
            "--layers", "1", "--embed", "8", "--heads", "2", "--block", "8", "--steps", "2",
            "--eval-every", "2", "--no-progress", "--threads", "1", "--checkpoint-dir",
            str(root / "ck")]  # fmt: skip
    proc = run_xpnn(args)
    assert proc.returncode == 0, proc.stderr
    found = latest_checkpoint(root / "ck")
    assert found is not None
    return found


def _refused(argv: list[str], capsys) -> str:
    code = generate_main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("xpnn generate: "), err
    return lines[0]


def _identity(arrays: dict) -> dict:
    return json.loads(str(arrays["meta.identity"]))


def _with_identity(**changed) -> object:
    def edit(arrays: dict) -> None:
        identity = _identity(arrays)
        for key, value in changed.items():
            if value is KeyError:
                identity.pop(key)
            else:
                identity[key] = value
        arrays["meta.identity"] = np.array(json.dumps(identity))

    return edit


def _param(arrays: dict) -> str:
    return next(k for k in sorted(arrays) if not k.startswith(("meta.", "optim.")))


DAMAGE = {
    "a wrong shape": lambda a: a.update({_param(a): a[_param(a)][:-1]}),
    "a missing parameter": lambda a: a.pop(_param(a)),
    "integer weights": lambda a: a.update({_param(a): a[_param(a)].astype(np.int32)}),
    "complex weights": lambda a: a.update({_param(a): a[_param(a)].astype(np.complex128)}),
    "NaN weights": lambda a: a[_param(a)].flat.__setitem__(0, np.nan),
    "identity not JSON": lambda a: a.update({"meta.identity": np.array("{not json")}),
    "no vocabulary": _with_identity(vocab=KeyError),
    "a vocabulary too short": lambda a: _with_identity(vocab=_identity(a)["vocab"][:-1])(a),
    "an empty vocabulary": _with_identity(vocab=""),
    "block 0": _with_identity(block=0),
    "block 10**12": _with_identity(block=10**12),
    "layers 10**12": _with_identity(layers=10**12),
    "heads 0": _with_identity(heads=0),
    "heads 3": _with_identity(heads=3),
    "embed a string": _with_identity(embed="8"),
    "not a gpt": _with_identity(model="mlp"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_generate_refuses_a_damaged_checkpoint_in_one_line(damage, gpt_checkpoint, tmp_path,
                                                           capsys):  # fmt: skip
    arrays = read_npz(gpt_checkpoint)
    DAMAGE[damage](arrays)
    path = tmp_path / gpt_checkpoint.name
    atomic_savez(path, arrays)
    line = _refused([str(path), "--chars", "5"], capsys)
    assert str(path) in line


def test_generate_samples_from_the_whole_checkpoint(gpt_checkpoint, capsys):
    assert generate_main([str(gpt_checkpoint), "--chars", "20", "--seed", "3"]) == 0
    assert set(capsys.readouterr().out.strip("\n")) <= set(CORPUS)


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--chars", "99999999999999999999"], "--chars: must be 0 to 1,000,000"),
        (["--chars", "-1"], "--chars: must be 0 to"),
        (["--temperature", "inf"], "--temperature: must be > 0 and finite"),
        (["--temperature", "nan"], "--temperature: must be > 0 and finite"),
        (["--seed", "12345678901234567890123"], "--seed: must be 0 to 2**64 - 1"),
        (["--chars", "lots"], "--chars: invalid int value: 'lots'"),
        (["--colour", "red"], "unrecognized arguments: --colour red"),
    ],
)
def test_generate_refuses_a_bad_value_in_one_line(flags, said, gpt_checkpoint, capsys):
    assert said in _refused([str(gpt_checkpoint), *flags], capsys)


@FEW
@given(
    flag=st.sampled_from(["--chars", "--temperature", "--seed"]),
    value=st.one_of(
        st.text(string.digits + ".-e", max_size=25), st.floats().map(repr), st.integers().map(str)
    ),  # fmt: skip
)
def test_generate_takes_any_value_or_refuses_it_in_one_line(
    flag, value, gpt_checkpoint, capsys, monkeypatch
):
    """What an accepted value is sampled with (the sampling itself stood in for: a million
    characters take minutes)."""
    taken = []
    monkeypatch.setattr(generate, "sample", lambda *a: taken.append(a) or "")
    code = generate.main([str(gpt_checkpoint), flag, value])
    err = capsys.readouterr().err
    assert code in (0, 2) and len(err.strip().splitlines()) == (code == 2), err
    if code == 0:
        _, _, chars, temperature, seed, _ = taken[0]
        assert 0 <= chars <= 1_000_000 and 0 <= seed < 2**64
        assert math.isfinite(temperature) and temperature > 0


# ------------------------------------------------------------------------------ xpnn trace

TRACE_ARGS = ["--dataset", "synthetic", "--synthetic-size", "200", "--batch-size", "50",
              "--hidden", "8", "--epochs", "1", "--threads", "1", "--no-progress"]  # fmt: skip
JSON = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),  # fmt: skip
    max_leaves=12,
)


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Path:
    """A real one-rank trace, made in the process."""
    from xpnn.commands import cli

    directory = tmp_path_factory.mktemp("trace")
    assert cli.main([*TRACE_ARGS, "--trace", str(directory), "--trace-steps", "1:3"]) == 0
    return directory


def _trace_refused(argv: list[str], capsys) -> str:
    from xpnn.record import timeline

    code = timeline.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("xpnn: trace"), err
    return lines[0]


def _copy_with_rank1(traced: Path, tmp_path: Path, rank1: object) -> Path:
    directory = tmp_path / "tr"
    directory.mkdir()
    (directory / "trace-rank0.json").write_bytes((traced / "trace-rank0.json").read_bytes())
    (directory / "trace-rank1.json").write_text(json.dumps(rank1))
    return directory


def _events_edited(traced: Path, edit) -> dict:
    doc = json.loads((traced / "trace-rank0.json").read_text())
    span = next(e for e in doc["traceEvents"] if e.get("ph") == "X")
    edit(span)
    return doc


MALFORMED = {
    "a list": lambda t: [1, 2, 3],
    "null": lambda t: None,
    "events not a list": lambda t: {"traceEvents": 5},
    "an event without dur": lambda t: _events_edited(t, lambda e: e.pop("dur")),
    "ts a string": lambda t: _events_edited(t, lambda e: e.update(ts="soon")),
    "a span without a category": lambda t: _events_edited(t, lambda e: e.pop("cat")),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_trace_refuses_a_malformed_rank_file_naming_it(case, traced, tmp_path, capsys):
    directory = _copy_with_rank1(traced, tmp_path, MALFORMED[case](traced))
    assert "trace-rank1.json" in _trace_refused([str(directory)], capsys)


@FEW
@given(doc=JSON)
def test_trace_takes_any_json_as_a_rank_file_or_refuses_it_in_one_line(doc, traced, tmp_path,
                                                                       capsys):  # fmt: skip
    from xpnn.record import timeline

    directory = tmp_path / "tr"
    if not directory.exists():
        directory.mkdir()
        (directory / "trace-rank0.json").write_bytes((traced / "trace-rank0.json").read_bytes())
    (directory / "flight-rank1.json").write_text(json.dumps(doc))
    code = timeline.main([str(directory)])
    err = capsys.readouterr().err
    assert code in (0, 2) and len(err.strip().splitlines()) == (code == 2), err


@pytest.mark.parametrize(
    "png, said",
    [("x.txt", "ending in .png"), ("/dev/full", "ending in .png"),
     ("{dir}", "ending in .png"), ("{dir}.png", "is a directory")],
)  # fmt: skip
def test_trace_png_refuses_what_is_no_png_file(png, said, traced, tmp_path, capsys):
    (tmp_path / "d.png").mkdir()
    target = png.format(dir=tmp_path / "d")
    assert said in _trace_refused([str(traced), "--png", target], capsys)


def test_trace_never_writes_over_its_own_input(traced, tmp_path, capsys):
    directory = _copy_with_rank1(
        traced, tmp_path, json.loads((traced / "trace-rank0.json").read_text())
    )
    kept = (directory / "trace-rank1.json").read_bytes()
    line = _trace_refused([str(directory), "-o", str(directory / "trace-rank1.json")], capsys)
    assert "a rank file this command reads" in line
    assert (directory / "trace-rank1.json").read_bytes() == kept


def test_trace_without_rank_0_says_the_clocks_are_not_aligned(traced, tmp_path, capsys):
    from xpnn.record import timeline

    directory = tmp_path / "tr"
    directory.mkdir()
    (directory / "trace-rank1.json").write_bytes((traced / "trace-rank0.json").read_bytes())
    assert timeline.main([str(directory)]) == 0
    assert "no trace-rank0.json" in capsys.readouterr().out


def test_trace_bad_flag_is_one_line(traced, capsys):
    assert "unrecognized arguments" in _trace_refused([str(traced), "--colour"], capsys)
