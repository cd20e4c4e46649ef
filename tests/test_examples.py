"""Every script in examples/ runs as its README says, at small sizes: the layer's own gradient
check, the model file through ``--model`` from another directory, the callback's table, the
GPT's training and sampling; the Slurm script parses (``bash -n``) and its xpnn flags pass
xpnn's own parser and checks."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT

from xpnn.errors import UserError
from xpnn.testing import check_layer

EXAMPLES = ROOT / "examples"


def _run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_is_in_the_readme():
    readme = (EXAMPLES / "README.md").read_text()
    scripts = sorted(p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sbatch"))
    assert scripts == ["callback.py", "gpt_sampling.py", "own_layer.py", "own_model.py",
                       "slurm.sbatch"]  # fmt: skip
    for name in scripts:
        assert f"`{name}`" in readme, name


def test_own_layer_checks_its_gradients(tmp_path):
    proc = _run([sys.executable, str(EXAMPLES / "own_layer.py")], tmp_path)
    assert proc.stdout == "PReLU: gradients match finite differences\n"


def test_own_layers_check_at_random_parameters_finds_a_forgotten_parameter():
    """A backward that uses alpha's initial 0.25 instead of alpha passes at the initial
    parameters, and fails once they are random: why the example checks both."""
    own = _module("own_layer")

    class Forgetful(own.PReLU):
        def backward(self, dy, need_dx=True):
            super().backward(dy, need_dx=False)  # alpha's gradient, right
            return dy * self.xp.where(self.x > 0, 1.0, 0.25)  # the input's, wrong

    check_layer(Forgetful(), (6,), batch=4)
    with pytest.raises(AssertionError):
        check_layer(Forgetful(), (6,), batch=4, before_forward=own.random_alpha)


def test_own_model_trains_through_the_command_line_from_another_directory(tmp_path):
    saved = tmp_path / "own.npz"
    args = [sys.executable, "-m", "xpnn", "--model", f"{EXAMPLES / 'own_model.py'}:build"]
    args += ["--dataset", "synthetic", "--synthetic-size", "600", "--epochs", "2"]
    args += ["--threads", "1", "--no-progress", "--save", str(saved)]
    proc = _run(args, tmp_path)
    assert "-> PReLU() -> Residual(LayerNorm() -> Dense(64, identity) -> PReLU())" in proc.stdout
    losses = [float(x) for x in re.findall(r"train_loss (\d+\.\d+)", proc.stdout)]
    assert len(losses) == 2 and losses[1] < losses[0], proc.stdout
    params = np.load(saved)
    assert {"layer1.alpha", "layer2.0.gamma", "layer2.2.alpha"} <= set(params.files)
    assert not np.all(params["layer1.alpha"] == 0.25)  # PReLU's alpha was trained


def test_the_callback_example_prints_the_schedule_it_saw(tmp_path):
    proc = _run([sys.executable, str(EXAMPLES / "callback.py"), "--epochs", "3"], tmp_path)
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["epoch", "first", "lr", "last", "lr", "test_loss", "test_acc"]
    rows = [[float(v) for v in line.split()] for line in lines[1:]]
    assert [row[0] for row in rows] == [1, 2, 3]
    (_, warm_first, warm_last, *_), (*_, last_lr, _, accuracy) = rows[0], rows[-1]
    assert warm_first < warm_last == pytest.approx(0.01)  # the warmup's epoch climbs to lr
    assert rows[-1][2] < 0.01 * 0.05 and rows[-1][2] == last_lr  # the cosine's floor is near
    assert accuracy >= 0.9


def test_the_gpt_example_trains_and_samples_the_text(tmp_path):
    script = [sys.executable, str(EXAMPLES / "gpt_sampling.py"), "--steps", "150"]
    proc = _run([*script, "--chars", "80"], tmp_path)
    first, _, sampled = proc.stdout.partition("\n")
    loss = float(re.fullmatch(r"after 150 steps: (\d+\.\d+) nats a character", first).group(1))
    assert loss < 0.8, proc.stdout  # from ln(vocabulary) ~ 3.2: it learned the rhyme
    assert len(sampled) == 80 + 1  # print's newline after the sample, which may hold some
    words = {"twinkle", "little", "star", "wonder", "above", "world", "diamond", "sky"}
    assert words & set(re.findall(r"[a-z]+", sampled.lower())), sampled


def _sbatch_lines() -> list[str]:
    return (EXAMPLES / "slurm.sbatch").read_text().splitlines()


def _xpnn_argv(env: dict[str, str]) -> list[str]:
    """The srun line's xpnn flags, continuation lines joined and Slurm's variables given."""
    text = (EXAMPLES / "slurm.sbatch").read_text().replace("\\\n", " ")
    (line,) = [t for t in text.splitlines() if t.startswith("srun ")]
    launcher, _, flags = line.partition(" python -m xpnn ")
    assert launcher == "srun --mpi=pmi2"
    for name, value in env.items():
        flags = flags.replace(f"${name}", value)
    assert "$" not in flags, flags
    return shlex.split(flags)


def test_the_slurm_script_is_bash_and_asks_slurm_for_the_requeue_recipe():
    subprocess.run(["bash", "-n", str(EXAMPLES / "slurm.sbatch")], check=True)
    options = {line.split()[1] for line in _sbatch_lines() if line.startswith("#SBATCH ")}
    assert {"--signal=USR1@60", "--requeue", "--open-mode=append"} <= options
    body = "\n".join(_sbatch_lines())
    assert 'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"' in body
    assert re.search(
        r'if \[ "\$code" -eq 75 \] \|\| \[ "\$code" -eq \$\(\(128 \+ \$\(kill -l USR1\)\)\) \]; '
        r"then.*\n.*\n\s+scontrol requeue",
        body,
    )


def test_the_slurm_scripts_flags_pass_xpnns_parser_and_checks():
    from xpnn.commands.flags import build_parser, to_spec
    from xpnn.run import train_config

    env = {"SLURM_CPUS_PER_TASK": "4", "SLURM_JOB_ID": "123"}
    args = build_parser().parse_args(_xpnn_argv(env))
    assert args.checkpoint_signal == "USR1" and args.resume
    spec = to_spec(args)
    assert spec.threads == 4 and spec.checkpoint_dir == "ck-123"
    assert spec.metrics == "run-123.jsonl" and not spec.progress
    train_config(spec)  # the checks the command line makes of its settings
    spec.epochs = 0
    with pytest.raises(UserError, match="`epochs`"):  # and they would refuse a bad one
        train_config(spec)
