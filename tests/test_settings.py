"""Each setting is declared once (``xpnn.settings``): docs/cli.md's tables are the
declarations' (``python tests/test_settings.py`` writes them), and the command line and a
program refuse and accept the same values, by the same rule."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

from xpnn.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
CLI_MD = ROOT / "docs" / "cli.md"


def regenerated(text: str) -> str:
    """``text`` (docs/cli.md) with each settings table replaced by the declarations' own."""
    from xpnn.commands.flags import settings_tables

    for group, table in settings_tables().items():
        pattern = rf"(^### {re.escape(group)}\n\n)(\|.*\n)+"
        text, found = re.subn(pattern, lambda m, t=table: m.group(1) + t, text, flags=re.M)
        assert found == 1, f"docs/cli.md has no table under '### {group}'"
    return text


def test_the_docs_tables_are_the_declarations():
    text = CLI_MD.read_text()
    assert regenerated(text) == text, "run `python tests/test_settings.py` to write them"


if __name__ == "__main__":
    CLI_MD.write_text(regenerated(CLI_MD.read_text()))
    sys.exit(0)


def _edges(rule) -> list[str]:
    """Texts at and around ``rule``'s bounds."""
    low, most = rule.low, rule.most
    step = 1 if rule.whole else max(abs(low) * 1e-6, 1e-9)
    texts = [low, low - step, low + step, -1, 0, 1, 0.5]
    if math.isfinite(most):
        texts += [most, most + step]
    if rule.below is not None:
        texts += [rule.below, rule.below - step]
    words = [
        str(int(t)) if rule.whole else repr(float(t))
        for t in texts
        if not rule.whole or t == int(t)
    ]
    return words + ([] if rule.whole else ["inf", "-inf", "nan"])


def _declared_ranges():
    from xpnn.settings import SETTINGS

    return [(name, s) for name, s in SETTINGS.items() if s.rule is not None]


@pytest.mark.parametrize(
    ("name", "setting"), _declared_ranges(), ids=lambda x: getattr(x, "group", x)
)
def test_the_command_line_and_a_program_refuse_the_same_values(name, setting):
    """One rule a setting: a value the flag refuses, ``RunSpec`` refuses too, each naming the
    setting its own way (``--flag`` / `` `name` ``), and both take the values it allows."""
    from xpnn.commands.flags import FLAGS, ArgError, build_parser
    from xpnn.errors import UserError
    from xpnn.run import RunSpec
    from xpnn.settings import check_settings

    parser, flag = build_parser(), FLAGS[name]
    for text in _edges(setting.rule):
        value = int(text) if setting.rule.whole else float(text)
        try:
            taken = getattr(parser.parse_args([flag, text]), name) == value
        except ArgError as exc:
            taken = False
            assert str(exc).startswith(f"{flag}: "), exc
        try:
            check_settings(RunSpec(**{name: value}))
            allowed = True
        except UserError as exc:
            allowed = False
            assert str(exc).startswith(f"`{name}`: "), exc
        assert taken == allowed, (name, text, taken, allowed)


def test_a_choice_the_flag_offers_a_program_may_give():
    from xpnn.commands.flags import build_parser
    from xpnn.errors import UserError
    from xpnn.run import RunSpec
    from xpnn.settings import SETTINGS, check_settings

    offered = {a.dest: a.choices for a in build_parser()._actions if a.choices}
    for name, setting in SETTINGS.items():
        if not setting.choices:
            continue
        assert set(offered[name]) <= set(setting.choices), name
        with pytest.raises(UserError, match=f"^`{name}` 'bogus': choose one of "):
            check_settings(RunSpec(**{name: "bogus"}))


def test_the_rule_is_said_the_same_where_the_words_agree():
    """Past the largest count or below a decay rate's 1: the same words from both sides."""
    from xpnn.commands.flags import ArgError, build_parser
    from xpnn.run import RunSpec
    from xpnn.settings import check_spec

    for name, flag, value in [("threads", "--threads", 5000), ("momentum", "--momentum", 1.0)]:
        with pytest.raises(ArgError) as cli:
            build_parser().parse_args([flag, str(value)])
        with pytest.raises(UserError) as lib:
            check_spec(RunSpec(**{name: value}))
        said = str(cli.value).removeprefix(f"{flag}: ")
        assert str(lib.value).removeprefix(f"`{name}`: ").startswith(said.split(", got")[0])


def test_every_optimizer_hyper_parameter_is_a_declared_setting():
    """What a new hyper-parameter needs: its optimizer's ``hyper_parameters`` and a declared
    ``RunSpec`` field; the trainer hands every declared one it takes to ``make_optimizer``."""
    from xpnn.run import RunSpec, train_config
    from xpnn.settings import SETTINGS
    from xpnn.train.optim import OPTIMIZERS

    for kind in OPTIMIZERS.values():
        assert set(kind.hyper_parameters) <= SETTINGS.keys(), kind
    cfg = train_config(RunSpec(optimizer="momentum", momentum=0.5, eps=1e-3))
    assert (cfg.momentum, cfg.eps) == (0.5, None)  # eps: not momentum's, left out
