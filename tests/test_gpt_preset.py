"""--model gpt's defaults: nanoGPT's small recipe for every setting the user left unset; the
settings given win, and the start-up lines say which were filled."""

import json

import pytest
from conftest import run_xpnn
from parallel.model.test_gpt_parallel import write_text

from xpnn.run import RunSpec
from xpnn.settings import gpt_preset

RECIPE = {
    "optimizer": "adamw", "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "lr": 1e-3,
    "schedule": "cosine", "warmup_steps": 100, "min_lr": 1e-4, "clip_norm": 1.0,
    "batch_size": 32,
}  # fmt: skip


def test_the_recipe_fills_a_gpt_spec_left_at_its_defaults():
    spec, filled = gpt_preset(RunSpec(model="gpt", dataset="tinyshakespeare"))
    assert filled == RECIPE
    for name, value in RECIPE.items():
        assert getattr(spec, name) == value
    mlp = RunSpec(model="mlp")
    assert gpt_preset(mlp) == (mlp, {})


@pytest.mark.parametrize(
    "chosen, given, unfilled",
    [
        ({"lr": 3e-4, "batch_size": 64}, None, {"lr", "batch_size"}),
        # typed but equal to the default: still the user's choice, as the command line says
        ({"optimizer": "adam"}, {"optimizer"}, {"optimizer", "weight_decay"}),
        ({"optimizer": "sgd"}, None, {"optimizer", "betas", "eps", "weight_decay"}),
        ({"schedule": "step"}, None, {"schedule", "min_lr"}),
        ({"warmup_epochs": 1.0}, None, {"warmup_steps"}),
        ({"per_rank_batch": 8}, None, {"batch_size"}),
    ],
)
def test_settings_given_win(chosen, given, unfilled):
    spec, filled = gpt_preset(RunSpec(model="gpt", **chosen), given)
    assert set(filled) == {"dataset", *RECIPE} - unfilled
    for name, value in chosen.items():
        assert getattr(spec, name) == value


def test_the_recipe_trains_on_tiny_shakespeare_unless_a_dataset_is_given():
    spec, filled = gpt_preset(RunSpec(model="gpt"))
    assert spec.dataset == filled["dataset"] == "tinyshakespeare"
    spec, filled = gpt_preset(RunSpec(model="gpt", dataset="text"))
    assert spec.dataset == "text" and "dataset" not in filled
    # typed on the command line, even as the image sets' default: the user's choice
    spec, filled = gpt_preset(RunSpec(model="gpt"), {"dataset"})
    assert spec.dataset == "fashion-mnist" and "dataset" not in filled


def test_model_gpt_alone_asks_for_tiny_shakespeare(tmp_path):
    """Offline and with an empty cache, ``--model gpt`` alone fails in one line that says where
    tiny Shakespeare was looked for and how to hand it over; another text is pointed at
    ``--dataset text``."""
    env = {
        "XPNN_DATA_HOME": str(tmp_path / "cache"),
        "XPNN_TINYSHAKESPEARE_MIRRORS": "http://127.0.0.1:9/",  # nothing listens there
    }
    proc = run_xpnn(["--model", "gpt", "--steps", "1", "--threads", "1"], env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert "tinyshakespeare" in lines[0] and "--data-dir holding input.txt" in lines[0]
    corpus = write_text(tmp_path / "corpus.txt")
    proc = run_xpnn(["--model", "gpt", "--steps", "1", "--data-dir", corpus], env=env)
    assert proc.returncode == 2, proc.stderr
    assert "not tiny Shakespeare's input.txt" in proc.stderr
    assert "--dataset text" in proc.stderr


def test_the_start_up_lines_name_what_the_recipe_filled(tmp_path):
    corpus = write_text(tmp_path / "corpus.txt")
    metrics = tmp_path / "m.jsonl"
    args = [
        "--model", "gpt", "--dataset", "text", "--data-dir", corpus, "--layers", "1",
        "--heads", "2", "--embed", "8", "--block", "6", "--steps", "2", "--threads", "1",
        "--no-progress", "--lr", "0.001", "--optimizer", "adam", "--metrics", str(metrics),
    ]  # fmt: skip
    proc = run_xpnn(args)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if "gpt recipe" in ln)
    assert "--betas 0.9,0.95" in line and "--clip-norm 1" in line and "--batch-size 32" in line
    assert "--lr" not in line and "--optimizer" not in line and "--weight-decay" not in line
    assert "global batch 32, adam lr 0.001" in proc.stdout
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records[-1]["preset"]["clip_norm"] == 1.0 and "optimizer" not in records[-1]["preset"]
    evals = [r for r in records if r["event"] == "eval"]
    assert evals and all(r["val_loss"] == r["test_loss"] and "tokens_per_s" in r for r in evals)


def test_a_setting_the_recipe_makes_effective_draws_no_note(tmp_path):
    """``--weight-decay`` alone: the recipe's AdamW uses it, so no "has no effect" note."""
    corpus = write_text(tmp_path / "corpus.txt")
    args = [
        "--model", "gpt", "--dataset", "text", "--data-dir", corpus, "--layers", "1",
        "--heads", "2", "--embed", "8", "--block", "6", "--steps", "1", "--threads", "1",
        "--no-progress", "--weight-decay", "0.05",
    ]  # fmt: skip
    proc = run_xpnn(args)
    assert proc.returncode == 0, proc.stderr
    assert "no effect" not in proc.stderr
    assert "adamw lr 0.001" in proc.stdout


def test_adamw_decays_the_gpt_matrices_and_nothing_else():
    """The decay ranges, from the nested parameter names' shapes: embeddings and Dense
    matrices decay; biases and LayerNorm gains and shifts do not."""
    import numpy as np

    from xpnn.backends import get_backend
    from xpnn.nn import gpt
    from xpnn.train.optim import matrix_ranges

    model = gpt(7, layers=2, heads=2, embed=8, block=4).build((4,), get_backend("numpy"), 0)
    names = model.param_names()
    shapes = [tuple(layer.params[name].shape) for _, layer, name in names]
    mask = np.zeros(model.size, dtype=bool)
    for lo, hi in matrix_ranges(shapes):
        mask[lo:hi] = True
    offset, decayed = 0, set()
    for (key, _, _), shape in zip(names, shapes, strict=True):
        size = int(np.prod(shape))
        assert mask[offset : offset + size].all() or not mask[offset : offset + size].any()
        if mask[offset]:
            decayed.add(key)
        offset += size
    assert "layer2.attn.sa.qkv.W" in decayed and "layer0.W" in decayed
    assert "layer3.mlp.ff.down.W" in decayed
    assert not {k for k in decayed if k.endswith((".b", ".gamma", ".beta"))}
    assert len(decayed) == 2 + 2 * 4 + 1  # embeddings, 4 matrices a block, the head
