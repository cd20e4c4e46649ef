"""The tutorial's walk, run from its own code blocks: a user's file written against the public
API trains through ``--model FILE.py:FUNCTION`` on 1 rank, 2 ranks data parallel and 2 ranks
pipeline parallel, to the same parameters in float64."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, assert_one_line_user_error, run_xpnn, train_and_load

TUTORIAL = ROOT / "docs" / "tutorial.md"
FLOAT64 = ["--dataset", "synthetic", "--synthetic-size", "600", "--epochs", "2"]
FLOAT64 += ["--dtype", "float64", "--no-progress", "--batch-size", "64"]


def code_block(first_line: str) -> str:
    """The tutorial's Python block that starts with ``first_line`` (its file name)."""
    blocks = re.findall(r"```python\n(.*?)```", TUTORIAL.read_text(), re.S)
    found = [b for b in blocks if b.startswith(first_line + "\n")]
    assert len(found) == 1, f"one block starting {first_line!r} in {TUTORIAL}"
    return found[0]


@pytest.fixture
def user_dir(tmp_path):
    for name in ("my.py", "check.py", "train.py"):
        (tmp_path / name).write_text(code_block(f"# {name}"))
    return tmp_path


def test_the_tutorials_layer_passes_its_gradient_check(user_dir):
    proc = subprocess.run(
        [sys.executable, "check.py"], cwd=user_dir, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "gradients match" in proc.stdout


def test_a_users_model_trains_the_same_on_one_rank_two_ranks_and_a_pipeline(user_dir, tmp_path):
    args = ["--model", f"{user_dir / 'my.py'}:build", *FLOAT64]
    one, rec1, proc = train_and_load(tmp_path, 1, args)
    assert "Residual(LayerNorm() -> Dense(64, identity) -> GELU())" in proc.stdout
    assert rec1[1]["train_loss"] < rec1[0]["train_loss"]  # it trained: equality is not trivial
    for mode in (["--parallel", "data"], ["--parallel", "pipeline"]):
        two, records, _ = train_and_load(tmp_path, 2, [*args, *mode])
        assert sorted(two) == sorted(one)
        assert {"layer1.0.gamma", "layer1.1.W", "layer2.s"} <= set(one)  # nested names
        for name, value in one.items():
            scale = float(np.max(np.abs(value))) or 1.0
            assert float(np.max(np.abs(two[name] - value))) <= 1e-9 * scale, (mode, name)
        assert records[-1]["ranks_agree"]


def test_the_tutorials_python_run_uses_the_factory(user_dir):
    proc = subprocess.run(
        [sys.executable, "train.py"], cwd=user_dir, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"test accuracy 0\.\d+|test accuracy 1\.0", proc.stdout), proc.stdout


@pytest.mark.parametrize(
    "where, message",
    [
        ("{dir}/my.py:nothing", "my.py has no function nothing"),
        ("{dir}/absent.py:build", "no file"),
        ("no_such_module:build", "--model no_such_module:build: no module no_such_module"),
        ("my.py", "expected mlp, cnn, gpt, FILE.py:FUNCTION or package.module:FUNCTION"),
    ],
)
def test_a_bad_model_path_is_one_line_naming_the_flag_on_every_rank(user_dir, where, message):
    args = ["--model", where.format(dir=user_dir), *FLOAT64]
    proc = run_xpnn(args, ranks=2, timeout=120)
    assert_one_line_user_error(proc, message)
    assert "--model" in proc.stderr


def test_a_factory_that_raises_is_named(tmp_path):
    (tmp_path / "bad.py").write_text("def build(shape, classes):\n    raise KeyError('x')\n")
    proc = run_xpnn(["--model", f"{tmp_path / 'bad.py'}:build", *FLOAT64], timeout=120)
    assert_one_line_user_error(proc, "bad.py:build: it raised KeyError: 'x'")


def test_run_from_python_raises_run_failed_with_the_exit_code(tmp_path):
    """``xpnn.run.run``: one line naming the parameter (not the flag), then ``RunFailed``."""
    script = tmp_path / "bad_run.py"
    script.write_text(
        "from xpnn.run import RunFailed, RunSpec, run\n"
        "try:\n"
        "    run(RunSpec(model='absent.py:build', dataset='synthetic', progress=False))\n"
        "except RunFailed as exc:\n"
        "    print('exit code', exc.exit_code)\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "exit code 2"
    assert proc.stderr.strip() == "xpnn: `model` absent.py:build: no file absent.py"
