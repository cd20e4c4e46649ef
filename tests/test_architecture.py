"""The import layering of docs/architecture.md: a violation fails the suite, not only CI."""

import ast
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

# Modules of xpnn that benchmarks may import names from besides packages (``__all__``), by
# name: a module's own ``__all__`` does not make it public (the command line has one).
PUBLIC_MODULES = {"xpnn.errors", "xpnn.train.optim", "xpnn.train", "xpnn.run", "xpnn.record.digest"}
PUBLIC_MODULES |= {"xpnn.commands.flags", "xpnn.testing"}
PUBLIC_MODULES |= {"xpnn.record.phases"}  # the seam that step timers and tracers listen on


def lint_imports() -> str:
    here = Path(sys.executable).parent / "lint-imports"
    found = str(here) if here.exists() else shutil.which("lint-imports")
    assert found, "lint-imports not found: pip install -e '.[test]' (import-linter)"
    return found


def test_the_import_contracts_hold():
    """Layers and backends never import parallel, train or cli; nothing imports cli; no
    import cycle between any two modules or packages (pyproject.toml, [tool.importlinter])."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [lint_imports(), "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout


def public_names(module: str) -> set[str] | None:
    """What ``from module import ...`` may take: a package's ``__all__``, a public module's
    names without a leading underscore; None where nothing may be taken."""
    mod = importlib.import_module(module)
    if hasattr(mod, "__path__"):  # a package: its __init__ is its public face
        return set(getattr(mod, "__all__", ()))
    if module in PUBLIC_MODULES:
        return {name for name in vars(mod) if not name.startswith("_")}
    return None


def xpnn_imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names taken from it, line) for every import of xpnn in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "xpnn":
            found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "xpnn":
                    found.append((alias.name, [], node.lineno))
    return found


# The modules beside xpnn's packages: the public paths (errors, run, testing), the entry point,
# the settings' declaration and the command line's own modules. Anything else belongs in the
# package of its job.
TOP_LEVEL = {"__init__", "__main__", "errors", "run", "testing", "settings"}
TOP_LEVEL |= {"cli", "flags", "outputs", "info", "presets"}


def test_the_top_level_holds_only_the_public_paths_and_the_command_line():
    """``xpnn/`` shows the architecture: a new module goes into a package by its job
    (``record``, ``train``, ``runtime``, ``commands``, ...), not beside them."""
    loose = {p.stem for p in (ROOT / "xpnn").glob("*.py")} - TOP_LEVEL
    assert not loose, sorted(loose)
    for module in ("xpnn.errors", "xpnn.run", "xpnn.testing", "xpnn.nn"):
        importlib.import_module(module)


@pytest.mark.parametrize(
    "script", sorted(str(p.relative_to(ROOT / "bench")) for p in (ROOT / "bench").rglob("*.py"))
)
def test_benchmarks_use_the_public_api(script):
    """bench/ takes names only from xpnn's packages (what their ``__init__`` exports) and its
    public modules: a benchmark that reaches into a module's insides breaks when it moves."""
    wrong = []
    for module, names, line in xpnn_imports(ROOT / "bench" / script):
        if module == "xpnn":  # `from xpnn import optim`: one module each
            pairs = [(f"xpnn.{name}", []) for name in names]
        else:
            pairs = [(module, names)]
        for target, taken in pairs:
            allowed = public_names(target)
            if allowed is None or set(taken) - allowed:
                bad = sorted(set(taken) - (allowed or set()))
                wrong.append(f"bench/{script}:{line}: {target} {bad}")
    assert not wrong, "not the public API:\n" + "\n".join(wrong)


def test_a_reach_into_a_module_is_found(tmp_path):
    """The check above can fail: a private module's name is refused."""
    script = tmp_path / "b.py"
    script.write_text(
        "from xpnn.parallel.model.shared import share_layers\nimport xpnn.commands.cli\n"
    )
    found = xpnn_imports(script)
    assert found == [
        ("xpnn.parallel.model.shared", ["share_layers"], 1),
        ("xpnn.commands.cli", [], 2),
    ]
    assert public_names("xpnn.parallel.model.shared") is None
    assert public_names("xpnn.commands.cli") is None  # the command line is not a library
    assert "flag_words" in public_names("xpnn.commands.flags")
    assert "_hidden" not in public_names("xpnn.commands.flags")
    assert "share_layers" in public_names("xpnn.parallel.model")


def test_the_training_loop_imports_nothing_that_extends_it():
    """The trainer keeps the loop: the callbacks, the checkpoints and resumes, the trace and the
    run's assembly import it, never the reverse, not even for annotations (which the import
    contracts leave out)."""
    extends = {"xpnn.train.callbacks", "xpnn.train.trace", "xpnn.run", "xpnn.train.checkpoint"}
    imported = set()
    for module, names, _ in xpnn_imports(ROOT / "xpnn" / "train" / "trainer.py"):
        imported |= {f"xpnn.{name}" for name in names} if module == "xpnn" else {module}
    assert not imported & extends, sorted(imported & extends)


def test_what_the_trainer_imports_never_imports_the_trainer_back():
    """No import loop through the trainer, not even one made of annotations
    (``if TYPE_CHECKING:``): a module the loop uses takes the trainer as an argument."""
    imported = set()
    for module, names, _ in xpnn_imports(ROOT / "xpnn" / "train" / "trainer.py"):
        imported |= {f"{module}.{name}" for name in names} | {module}
    loops = []
    for module in sorted(imported):
        path = ROOT / (module.replace(".", "/") + ".py")
        if path.is_file():
            back = [m for m, _, _ in xpnn_imports(path) if m == "xpnn.train.trainer"]
            loops += [module] if back else []
    assert not loops, loops


def patches(source: str, name: str = "<source>") -> list[str]:
    """Where ``source`` assigns a function (a lambda, a ``def`` of the file, a method named
    as one) onto an attribute of an object other than ``self``/``cls`` (directly or by
    ``setattr``), deletes such an attribute, or asks ``vars(x)`` whether a name was set."""
    tree = ast.parse(source, name)
    defs = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}

    def function(value: ast.expr) -> bool:
        if isinstance(value, ast.Lambda):
            return True
        if isinstance(value, ast.Name):
            return value.id in defs
        return isinstance(value, ast.Attribute) and value.attr in defs

    def foreign(target: ast.expr) -> bool:
        own = isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
        return isinstance(target, ast.Attribute) and not (
            own and target.value.id in ("self", "cls")
        )

    found = []
    for node in ast.walk(tree):
        pairs: list[tuple[ast.expr, ast.expr]] = []
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs += list(zip(target.elts, node.value.elts, strict=False))
                else:
                    pairs.append((target, node.value))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "setattr" and len(node.args) == 3:
                pairs.append((ast.Attribute(value=node.args[0], attr="?"), node.args[2]))
        if any(foreign(t) and function(v) for t, v in pairs):
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Delete) and any(foreign(t) for t in node.targets):
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Compare) and any(isinstance(op, ast.In) for op in node.ops):
            call = node.comparators[-1]
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "vars":
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_method_is_assigned_onto_an_object():
    """xpnn is extended through hooks and small protocols (the optimizer's step hooks and
    skip rules, callbacks), never by replacing another object's methods at run time."""
    found = []
    for path in sorted((ROOT / "xpnn").rglob("*.py")):
        found += patches(path.read_text(), str(path.relative_to(ROOT)))
    assert not found, "methods assigned onto objects:\n" + "\n".join(found)


def test_a_patch_is_found():
    """The check above can fail: each way of patching an object is found, and an object's
    own callable attributes are not."""
    source = """
def wrapped():
    pass
class A:
    def m(self, opt):
        start = opt.start_step
        opt.start_step = wrapped
        opt.step, opt.lr = lambda: 0, 0.1
        setattr(opt, "update_part", self.m)
        own = "start_step" in vars(opt)
        del opt.start_step
        self.ready = self.m
        opt.lr = start
"""
    lines = sorted(int(line.split(":")[1]) for line in patches(source, "s"))
    assert lines == [7, 8, 9, 10, 11], patches(source, "s")
