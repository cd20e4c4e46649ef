"""The user documentation cannot rot silently: docs/cli.md and ``--help`` name the same flags,
the README stays short and its links resolve, the documented ``info`` runs, the site builds
with ``mkdocs build --strict``, and no history words come back into the files users read."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

CLI_MD = ROOT / "docs" / "cli.md"
README = ROOT / "README.md"
README_MOST_LINES = 260

# The files the history-words check reads: everything a user or contributor reads.
HISTORY_PATHS = ["README.md", "docs", "examples", "xpnn", "tests", "bench", "ci", ".ci"]
HISTORY_PATHS += ["mkdocs.yml"]
HISTORY_WORDS = re.compile(r"\bsessions?\b|(before|since|until) the [0-9]+(st|nd|rd|th)", re.I)
HISTORY_ALLOWED = re.compile(r"test session|scope=.session.", re.I)  # pytest's own wording

FLAG = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")
HELP_FLAGS = {"-h", "--help"}


def _help(subcommand: str) -> subprocess.CompletedProcess[str]:
    argv = [] if subcommand == "train" else [subcommand]
    return subprocess.run(
        [sys.executable, "-m", "xpnn", *argv, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def _help_flags(text: str) -> set[str]:
    """Flags of argparse's option lines (``  -o FILE, --output FILE   help``): the text, not
    the parser object, since ``--help`` is what a user reads and the parsers may move."""
    flags: set[str] = set()
    for line in text.splitlines():
        if re.match(r"^ {2}-", line):
            invocation = re.split(r" {2,}", line.strip(), maxsplit=1)[0]
            flags.update(FLAG.findall(invocation))
    return flags - HELP_FLAGS


def _documented_sections() -> dict[str, str]:
    """docs/cli.md's sections per subcommand: ``## `python -m xpnn SUB` `` up to the next
    ``## ``."""
    sections: dict[str, str] = {}
    for chunk in re.split(r"^## ", CLI_MD.read_text(), flags=re.M)[1:]:
        heading, _, body = chunk.partition("\n")
        match = re.fullmatch(r"`python -m xpnn (\w+)`", heading.strip())
        if match:
            sections[match.group(1)] = body
    return sections


def _documented_flags(section: str) -> set[str]:
    """The flags in the first cell of each row of the section's flag tables."""
    flags: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `-"):
            flags.update(FLAG.findall(line.split("|")[1]))
    return flags


def test_every_subcommand_of_help_has_a_section() -> None:
    main = _help("train")
    assert main.returncode == 0, main.stderr
    named = {"train"} | set(re.findall(r"python -m xpnn (\w+)", main.stdout))
    missing = named - set(_documented_sections())
    assert not missing, f"docs/cli.md has no '## `python -m xpnn SUB`' section for {missing}"


@pytest.mark.parametrize("subcommand", sorted(_documented_sections()))
def test_cli_md_and_help_name_the_same_flags(subcommand: str) -> None:
    proc = _help(subcommand)
    assert proc.returncode == 0, (
        f"docs/cli.md documents `python -m xpnn {subcommand}`, but its --help fails: "
        f"{proc.stderr.strip()}"
    )
    usage = proc.stdout.partition("\n")[0]
    assert re.search(rf"python -m xpnn \[?{subcommand}\b", usage), (
        f"docs/cli.md documents `python -m xpnn {subcommand}`, which is no subcommand: {usage}"
    )
    assert "``" not in proc.stdout, f"reStructuredText markup in {subcommand} --help"
    in_help = _help_flags(proc.stdout)
    documented = _documented_flags(_documented_sections()[subcommand])
    assert in_help, f"no flags parsed from `python -m xpnn {subcommand} --help`"
    assert not in_help - documented, f"missing from docs/cli.md: {sorted(in_help - documented)}"
    assert not documented - in_help, f"not in --help: {sorted(documented - in_help)}"


def test_help_flag_parser_reads_argparse_layout() -> None:
    text = (
        "options:\n  -h, --help            show this help message and exit\n"
        "  --backend {numpy,numba}\n                        array library (--lr too)\n"
        "  -o FILE.png, --output FILE.png  where\n  --resume              continue\n"
    )
    assert _help_flags(text) == {"--backend", "-o", "--output", "--resume"}


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MOST_LINES, f"README.md has {lines} lines, at most {README_MOST_LINES}"


def test_readme_links_resolve() -> None:
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if "://" not in t]
    assert local, "README.md links into docs/"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_info_runs_as_documented() -> None:
    assert "python -m xpnn info" in CLI_MD.read_text()
    assert "python -m xpnn info" in README.read_text()
    proc = subprocess.run(
        [sys.executable, "-m", "xpnn", "info"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    for line in ("backends:", "numpy", "MPI:", "CUDA-aware"):
        assert line in proc.stdout, proc.stdout
    as_json = subprocess.run(
        [sys.executable, "-m", "xpnn", "info", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert as_json.returncode == 0, as_json.stderr
    assert isinstance(json.loads(as_json.stdout), dict)


def _history_lines(paths: list[str]) -> list[str]:
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", *paths],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.split()
    found = []
    for name in sorted(set(files)):
        path = ROOT / name
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if HISTORY_WORDS.search(HISTORY_ALLOWED.sub("", line)):
                found.append(f"{name}:{number}: {line.strip()}")
    return found


def test_no_history_words() -> None:
    found = _history_lines(HISTORY_PATHS)
    assert not found, "history belongs in git log:\n" + "\n".join(found)


def test_history_check_finds_history() -> None:
    word, before = "sess" + "ion", "Before the"  # apart, so that this file passes its own check
    for bad in (f"in the 17th {word}", f"{before} 19th, it hung", f"since {'the'} 2nd run"):
        assert HISTORY_WORDS.search(HISTORY_ALLOWED.sub("", bad)), bad
    for fine in ("pytest's test session starts", "the 2nd rank", "before the run"):
        assert not HISTORY_WORDS.search(HISTORY_ALLOWED.sub("", fine)), fine


def test_mkdocs_builds_strictly(tmp_path: Path) -> None:
    assert importlib.util.find_spec("mkdocs"), "mkdocs missing: pip install -e '.[test]'"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    # from file:// a link to a directory opens its listing: every page is a file, linked so
    home = (tmp_path / "index.html").read_text()
    assert (tmp_path / "cli.html").exists() and 'href="cli.html"' in home
    local = re.findall(r'href="([^":#?]+)"', home)
    assert local and not [link for link in local if link.endswith("/")], local
    assert "fonts.googleapis.com" not in home  # nothing fetched from the network
    assert (tmp_path / "search" / "search_index.js").exists()  # search without a server
    assert "content.code.copy" in home  # copyable code blocks (Material's feature flag)


def _page_code(page: str, after: str) -> tuple[str, str]:
    """docs/``page``'s first Python block after the text ``after``, and the page's text."""
    text = (ROOT / "docs" / page).read_text()
    section = text.split(after, 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1), section


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_python_api_sweep_runs_as_written() -> None:
    code, _ = _page_code("python-api.md", "## A learning-rate sweep")
    text = (ROOT / "docs" / "python-api.md").read_text()
    proc = _run([sys.executable, "-c", code])
    printed = dict(re.findall(r"lr ([\d.]+): test accuracy (\d\.\d+)", proc.stdout))
    assert set(printed) == {"0.01", "0.1"}, proc.stdout
    assert float(printed["0.1"]) >= 0.9, proc.stdout  # the synthetic set is learnable
    for lr, accuracy in printed.items():  # the numbers the page quotes
        assert f"lr {lr}: test accuracy {accuracy}" in text, proc.stdout


def test_python_api_run_spec_example_runs_as_written() -> None:
    """The page's RunSpec example prints what the page says, alone and on two ranks."""
    from conftest import mpiexec_path

    code, section = _page_code("python-api.md", "## A whole run from a `RunSpec`")
    quoted = re.search(r"It prints `(test accuracy [^`]+)`", section).group(1)
    for cmd in (
        [sys.executable, "-c", code],
        [mpiexec_path(), "-n", "2", sys.executable, "-c", code],
    ):
        assert _run(cmd).stdout.strip() == quoted


def test_the_parallelism_page_batch_threads_example_runs_as_written() -> None:
    code, _ = _page_code("parallelism.md", "**Batch threads")
    out = _run([sys.executable, "-c", code]).stdout
    assert re.fullmatch(r"loss \d\.\d{3} nats a character\n", out), out


def _layer_rows() -> dict[str, str]:
    """model-api.md's table of the library's layers: its first cell's code, by its start."""
    text = (ROOT / "docs" / "model-api.md").read_text()
    section = text.partition("## The library's layers")[2].partition("\n## ")[0]
    return {row.split("|")[1].strip(): row for row in section.splitlines() if row.startswith("| `")}


def test_model_api_names_every_parameter_of_the_library_layers() -> None:
    """Each layer's parameters, as ``named_params`` and a ``--save`` file name them, appear in
    its row of the table; the GPT's names the page quotes are the ones a model has."""
    from xpnn.backends import get_backend
    from xpnn.nn import (
        CausalSelfAttention,
        Chain,
        Dense,
        Embedding,
        FeedForward,
        LayerNorm,
        PositionEmbedding,
        Sequential,
        gpt,
        transformer_block,
    )
    from xpnn.nn.conv import Conv2D

    built = {  # the row's first code, a layer, the shape of one sample it takes
        "`Dense(": (Dense(3), (4,)),
        "`xpnn.nn.conv.Conv2D(": (Conv2D(2, 3), (1, 5, 5)),
        "`LayerNorm(": (LayerNorm(), (3, 4)),
        "`Embedding(": (Embedding(5, 4), (3,)),
        "`PositionEmbedding(": (PositionEmbedding(4), (3, 4)),
        "`CausalSelfAttention(": (CausalSelfAttention(4, 2), (3, 4)),
        "`FeedForward(": (FeedForward(4, 8), (3, 4)),
        "`transformer_block(": (transformer_block(4, 2), (3, 4)),
        "`Chain(": (Chain({"norm": LayerNorm(), "out": Dense(4)}), (3,)),
    }
    rows = _layer_rows()
    backend = get_backend("numpy", "float64")
    for start, (layer, shape) in built.items():
        (row,) = [row for first, row in rows.items() if first.startswith(start)]
        Sequential([layer]).build(shape, backend, 0)
        missing = [name for name in layer.params if f"`{name}`" not in row]
        assert layer.params and not missing, f"model-api.md's {start} row lacks {missing}"
    text = (ROOT / "docs" / "model-api.md").read_text()
    names = gpt(5, layers=1, heads=2, embed=4, block=3).build((3,), backend, 0).named_params()
    for quoted in ("layer2.attn.ln.gamma", "layer3.gamma"):
        assert f"`{quoted}`" in text and quoted in names, quoted
