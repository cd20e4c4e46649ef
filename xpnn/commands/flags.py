"""The training flags from the settings' declarations: parser, ``to_spec``, ``flag_words``, docs."""

import argparse
import difflib
import re
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

from xpnn.errors import PARAM, UserError
from xpnn.planner.auto import AUTO, CHOSEN
from xpnn.record.timeline import parse_steps
from xpnn.run import RunSpec
from xpnn.settings import DEFAULTS, MOST, OUTPUTS, RATE, SETTINGS, Setting
from xpnn.train.callbacks import SIGNALS

# The command line's own: its exit code 75 is a requeue's cue
CHECKPOINT_SIGNAL = OUTPUTS(None, choices=SIGNALS, metavar="USR1")(
    "On this signal (``USR1`` or ``USR2``; under hydra's ``mpiexec``, ``USR1``: it passes SIGUSR2 "
    "on to no rank), every rank finishes the step under way, the checkpoint of that moment is "
    "written (mid-epoch: ``checkpoint-epochNNNN-stepSSSSSSSS.npz``, from which ``--resume`` goes "
    "on bit for bit), and the job exits 75: a requeue script's cue to resubmit with ``--resume`` "
    "(``sbatch --signal=USR1@600``). Needs ``--checkpoint-dir``."
).metadata["setting"]
DECLARED = {**SETTINGS, "checkpoint_signal": CHECKPOINT_SIGNAL}  # every training flag
# Each parameter's flag: ``batch_size`` -> ``--batch-size``.
FLAGS = {name: s.flag or f"--{name.replace('_', '-')}" for name, s in DECLARED.items()}


class ArgError(UserError):
    """A bad flag, in one line naming it (the parser's error, without the usage)."""


class Parser(argparse.ArgumentParser):
    """argparse saying a bad flag in one line (``ArgError``), with no abbreviations, typos named."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ArgError(message.removeprefix("argument "))

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        known, unknown = self.parse_known_args(args, namespace)
        if not unknown:
            return known
        flags = [f for action in self._actions for f in action.option_strings]
        line = f"unrecognized arguments: {' '.join(unknown)}"
        for word in unknown:
            if (typed := word.split("=", 1)[0]).startswith("--"):
                # a cut-short flag means the one it begins; else the closest spelling
                close = [f for f in flags if f.startswith(typed)][:1]
                close = close or difflib.get_close_matches(typed, flags, n=1, cutoff=0.6)
                if close:
                    raise ArgError(f"{line} (did you mean {close[0]}?)")
        raise ArgError(line)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(t) for t in text.split(","))  # "16,,8" is a typo, not "16,8"
    except ValueError:
        raise ValueError(f"expected sizes like 512,256, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"sizes must be positive, got {text!r}")
    if max(sizes) > MOST:
        raise ValueError(f"sizes must be at most {MOST}, got {text!r}")
    return sizes


def _rates(text: str) -> tuple[float, float]:
    if len(parts := text.split(",")) != 2:
        raise ValueError(f"expected two rates like 0.9,0.999, got {text!r}")
    return RATE.read(parts[0]), RATE.read(parts[1])


def _path(text: str) -> str:
    """An empty name is a slip (the shell's ``--save $UNSET``)."""
    if not text.strip():
        raise ValueError("empty path")
    return text


def _resume(text: str) -> str:
    if text != "auto":
        raise ValueError(f"{text!r}: expected auto, or nothing")
    return text


def _steps(text: str) -> str:
    parse_steps(text)  # its ValueError names what is wrong
    return text


READERS = {"sizes": _sizes, "rates": _rates, "path": _path, "resume": _resume, "steps": _steps}


def typed(read: Callable[[str], Any], auto: bool = False) -> Callable[[str], Any]:
    """``read`` as argparse's type; with ``auto``, the planner's word too."""

    def parse(text: str) -> Any:
        try:
            return AUTO if auto and text == AUTO else read(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _plain(markdown: str) -> str:
    """A declaration's words as ``--help`` says them: no code marks, a link's words alone."""
    return re.sub(r"\[([^]]*)\]\([^)]*\)", r"\1", markdown).replace("`", "").replace("%", "%%")


def _add(parser: argparse.ArgumentParser, name: str, s: Setting) -> None:
    default = DEFAULTS.get(name)
    kw: dict[str, Any] = {"help": f"{_plain(s.help)} (default {_plain(s.said_default(default))})"}
    if s.read == "resume":  # a switch that may say auto
        kw |= {"nargs": "?", "const": True, "default": False}
    elif isinstance(default, bool) or name == "recompute":  # a switch
        parser.add_argument(FLAGS[name], action="store_true", **kw)
        return
    if read := READERS.get(s.read) or (s.rule.read if s.rule else None):
        kw["type"] = typed(read, name in CHOSEN)
    if s.choices:
        kw["choices"] = [c for c in s.choices if c not in s.unoffered]
    parser.add_argument(FLAGS[name], metavar=s.metavar, **kw)


def build_info_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m xpnn info", description="What this machine offers to xpnn.")
    p.add_argument("--json", action="store_true", help="machine-readable")
    return p


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m xpnn",
        usage="python -m xpnn [train] [flags]  |  --version  |  info [--json]  |  plot "
        "METRICS.jsonl... [-o PNG]  |  trace DIR [-o MERGED]  |  generate CHECKPOINT [--chars N]",
        description="Train a network over xp, alone or under MPI (mpiexec -n N python -m xpnn "
        "...). `python -m xpnn info` says what this machine offers: backends, devices, cores, "
        "the MPI library and whether it is CUDA-aware.",
    )
    for name, s in DECLARED.items():
        _add(p, name, s)
    p.set_defaults(**DEFAULTS)
    return p


def flag_words(text: str) -> str:
    """A library message as the command line says it: each parameter named as its flag."""
    return PARAM.sub(lambda m: FLAGS.get(m[1], m[0]), text)


def to_spec(args: argparse.Namespace) -> RunSpec:
    given = vars(args)
    spec = RunSpec(**{f.name: given[f.name] for f in fields(RunSpec) if f.name in given})
    spec.progress = not args.no_progress
    return spec


def typed_settings(parser: argparse.ArgumentParser, argv: list[str]) -> frozenset[str]:
    """The ``RunSpec`` fields whose flags ``argv`` types (parsed again with no defaults)."""
    unset = object()  # a flag's value before the command line sets it
    probe = argparse.Namespace(**{f.name: unset for f in fields(RunSpec)})
    parser.parse_args(argv, namespace=probe)
    return frozenset(name for name, value in vars(probe).items() if value is not unset)


def settings_tables() -> dict[str, str]:
    """docs/cli.md's tables of the training flags (heading -> Markdown)."""
    groups: dict[str, list[str]] = {}
    for name, s in DECLARED.items():
        shape = s.metavar or ("{" + ",".join(c for c in s.choices if c not in s.unoffered) + "}")
        if s.read == "resume":
            shape = f"[{shape}]"
        switch = isinstance(DEFAULTS.get(name), bool) and s.read != "resume"
        cell = FLAGS[name] if switch or name == "recompute" else f"{FLAGS[name]} {shape}"
        said = f"| `{cell}` | {s.said_default(DEFAULTS.get(name))} | {s.help} |"
        groups.setdefault(s.group, []).append(re.sub("``", "`", said))
    head = "| Flag | Default | Meaning |\n|---|---|---|\n"
    return {group: head + "\n".join(rows) + "\n" for group, rows in groups.items()}
