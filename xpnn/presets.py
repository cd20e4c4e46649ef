"""``--model gpt``'s recipe: nanoGPT's small-model training settings, and its text, as the
defaults of every setting the user left unset (the settings given win)."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

GPT_OPTIMIZER = "adamw"
GPT_BETAS = (0.9, 0.95)
GPT_EPS = 1e-8
GPT_WEIGHT_DECAY = 0.1  # on the matrices only (AdamW's decay ranges)
GPT_LR = 1e-3
GPT_SCHEDULE = "cosine"
GPT_WARMUP_STEPS = 100
GPT_MIN_LR = 1e-4
GPT_CLIP_NORM = 1.0
GPT_BATCH = 32
GPT_DATASET = "tinyshakespeare"  # the image sets' default cannot train a GPT


def given_settings(spec: Any, given: Collection[str] | None = None) -> set[str]:
    """The settings the caller chose: ``given`` where the caller says (the command line lists
    the flags typed), else those of ``spec`` that differ from their defaults."""
    if given is not None:
        return set(given)
    out = set()
    for f in dataclasses.fields(spec):
        default = f.default if f.default is not dataclasses.MISSING else None
        if getattr(spec, f.name) != default:
            out.add(f.name)
    return out


def gpt_preset(spec: Any, given: Collection[str] | None = None) -> tuple[Any, dict[str, Any]]:
    """``spec`` with the GPT recipe filling what it leaves unset, and what was filled (name ->
    value); ``spec`` itself for other models."""
    if spec.model != "gpt":
        return spec, {}
    given = given_settings(spec, given)
    fill: dict[str, Any] = {}
    optimizer = spec.optimizer if "optimizer" in given else GPT_OPTIMIZER
    schedule = spec.schedule if "schedule" in given else GPT_SCHEDULE
    wanted = {
        "dataset": (GPT_DATASET, True),
        "optimizer": (optimizer, True),
        "betas": (GPT_BETAS, optimizer in ("adam", "adamw")),
        "eps": (GPT_EPS, optimizer in ("adam", "adamw")),
        "weight_decay": (GPT_WEIGHT_DECAY, optimizer == "adamw"),
        "lr": (GPT_LR, True),
        "schedule": (schedule, True),
        "warmup_steps": (GPT_WARMUP_STEPS, "warmup_epochs" not in given),
        "min_lr": (GPT_MIN_LR, schedule == "cosine"),
        "clip_norm": (GPT_CLIP_NORM, True),
        "batch_size": (GPT_BATCH, "per_rank_batch" not in given),
    }
    for name, (value, applies) in wanted.items():
        if applies and name not in given:
            fill[name] = value
    return dataclasses.replace(spec, **fill), fill


def describe_preset(fill: dict[str, Any]) -> str:
    """The filled settings as a start-up line names them (``name`` value)."""
    words = []
    for name, value in fill.items():
        shown = ",".join(f"{v:g}" for v in value) if isinstance(value, (tuple, list)) else value
        shown = f"{shown:g}" if isinstance(shown, float) else shown
        words.append(f"`{name}` {shown}")
    return ", ".join(words)
