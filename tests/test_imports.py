"""The package's import structure: no import cycle, the layering of DESIGN.md, optional packages only on demand.

The graph is read from the source with ``ast`` (module-level imports only: those inside functions and under
``if TYPE_CHECKING:`` do not run at import time), so a test fails on the edge itself, not on its symptoms.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import sparseswaps_prune
from sparseswaps_prune.extras import require

PACKAGE = "sparseswaps_prune"
ROOT = Path(sparseswaps_prune.__file__).resolve().parent
# Packages of the extras; none may be imported by `import sparseswaps_prune` or, beyond what Lightning itself
# imports, by `import sparseswaps_prune.callbacks`.
OPTIONAL = ("transformers", "datasets", "lm_eval", "peft", "matplotlib", "gguf", "accelerate", "sentencepiece")


def _module_files() -> dict[str, Path]:
    files = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join((PACKAGE, *parts))] = path
    return files


MODULES = _module_files()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported (not in functions, classes or TYPE_CHECKING)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if not _is_type_checking(node.test):
                found += _module_level(node.body)
            found += _module_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                found += _module_level(block)
        elif isinstance(node, ast.With):
            found += _module_level(node.body)
    return found


def _imports(module: str) -> tuple[set[str], set[str], list[str]]:
    """``(package modules, third-party top-level names, private names from other package modules)``."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    internal: set[str] = set()
    external: set[str] = set()
    private: list[str] = []
    for node in _module_level(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).rstrip(".")
            targets = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in MODULES else base)
                if sub not in MODULES and alias.name.startswith("_") and base.startswith(PACKAGE) and base != module:
                    private.append(f"{base}.{alias.name}")
        for target in targets:
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                internal.add(target)
            elif target != "__future__":
                external.add(target.split(".")[0])
    return internal, external, private


GRAPH = {module: _imports(module) for module in MODULES}


def _closure(start: str) -> set[str]:
    """Every package module that ``import start`` executes (its parent packages included)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        module = todo.pop()
        if module in seen or module not in MODULES:
            continue
        seen.add(module)
        todo += GRAPH[module][0]
        todo += [module.rsplit(".", i)[0] for i in range(1, module.count("."))]
    return seen


def test_every_module_imports() -> None:
    for module in MODULES:
        importlib.import_module(module)


def test_no_import_cycle() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH[module][0]):
            if state.get(target) == 1:
                cycle = [*path[path.index(target) :], target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in MODULES:
        if module not in state:
            visit(module)


def test_layering() -> None:
    def imports(prefix: str) -> set[str]:
        inside = [internal for m, (internal, _, _) in GRAPH.items() if m == prefix or m.startswith(prefix + ".")]
        return set().union(*inside)

    core = f"{PACKAGE}.core"
    assert {t for t in imports(core) if not t.startswith(core)} == set(), "core/ imports only core/"
    upper = (f"{PACKAGE}.llm", f"{PACKAGE}.callbacks", f"{PACKAGE}.finetune", f"{PACKAGE}.cli")
    for base in (f"{PACKAGE}.modules", f"{PACKAGE}.prune", f"{PACKAGE}.extras", f"{PACKAGE}.atomic"):
        assert not [t for t in imports(base) if t.startswith(upper)], base
    assert not [t for t in imports(f"{PACKAGE}.callbacks") if t.startswith((f"{PACKAGE}.llm", f"{PACKAGE}.finetune"))]
    assert not [t for t in imports(f"{PACKAGE}.finetune") if t.startswith(f"{PACKAGE}.callbacks")]
    assert not [t for t in imports(f"{PACKAGE}.llm") if t.startswith((f"{PACKAGE}.callbacks", f"{PACKAGE}.finetune"))]


def test_no_private_names_across_modules() -> None:
    private = {m: names for m, (_, _, names) in GRAPH.items() if names}
    assert private == {}


def test_optional_packages_not_imported_at_module_level() -> None:
    """Statically: what ``import sparseswaps_prune`` / ``sparseswaps_prune.callbacks`` runs imports no package of
    an extra except Lightning (the callback's own extra)."""
    for start in (PACKAGE, f"{PACKAGE}.callbacks"):
        third_party = {name for module in _closure(start) for name in GRAPH[module][1]}
        assert not third_party & set(OPTIONAL), start


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)


def test_import_pulls_no_optional_package() -> None:
    result = _run(
        "import sys, sparseswaps_prune, sparseswaps_prune.modules, sparseswaps_prune.prune\n"
        f"print(sorted(m for m in {(*OPTIONAL, 'lightning')!r} if m in sys.modules))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_callbacks_import_adds_nothing_to_lightning() -> None:
    """``import lightning.pytorch`` itself imports transformers and matplotlib through torchmetrics when they are
    installed (not when they are not); importing the callbacks must add no optional package to that."""
    result = _run(
        "import sys\n"
        f"names = {OPTIONAL!r}\n"
        "import lightning.pytorch\n"
        "before = sorted(m for m in names if m in sys.modules)\n"
        "import sparseswaps_prune.callbacks\n"
        "print(before == sorted(m for m in names if m in sys.modules))"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_cli_help_and_clear_error_without_extras() -> None:
    """With every optional package hidden, ``--help`` works and a command that needs one names the extra."""
    result = _run(
        "import sys\n"
        f"for name in {(*OPTIONAL, 'lightning')!r}:\n"
        "    sys.modules[name] = None  # import fails as if not installed\n"
        "from sparseswaps_prune.cli import main\n"
        "from sparseswaps_prune.llm.models import tiny_model\n"
        "try:\n"
        "    tiny_model('llama')\n"
        "except ImportError as err:\n"
        "    print(err)\n"
        "main(['--help'])\n"
    )
    assert result.returncode == 0, result.stderr
    assert "transformers is not installed; this needs the 'llm' extra: pip install 'sparseswaps-prune[llm]'" in (
        result.stdout
    )
    assert "usage:" in result.stdout


def test_require() -> None:
    require("llm", "torch")
    with pytest.raises(ImportError, match=r"pip install 'sparseswaps-prune\[eval\]'") as err:
        require("eval", "torch", "sparseswaps_no_such_module")
    assert err.value.name == "sparseswaps_no_such_module"
