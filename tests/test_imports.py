"""The package's import structure: no import cycle, the layering of DESIGN.md, optional packages only on demand.

The graphs are read from the source with ``ast``, so a test fails on the edge itself, not on its symptoms: ``GRAPH``
holds the module-level imports (what runs at import time: not those inside functions or under
``if TYPE_CHECKING:``), ``ALL_GRAPH`` every import anywhere in a module that can run (inside functions and methods
too; not under ``if TYPE_CHECKING:``): no cycle
may close through either, an import inside a function included (those are for optional packages only).
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


def _tree(module: str) -> ast.Module:
    path = MODULES[module]
    return ast.parse(path.read_text(), str(path))


def _anywhere(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of the module that can run, wherever it stands (functions, methods, classes,
    conditions); those under ``if TYPE_CHECKING:`` never run and are left out (their ``else`` is kept)."""
    if isinstance(tree, (ast.Import, ast.ImportFrom)):
        return [tree]
    if isinstance(tree, ast.If) and _is_type_checking(tree.test):
        return [node for child in tree.orelse for node in _anywhere(child)]
    return [node for child in ast.iter_child_nodes(tree) for node in _anywhere(child)]


def _imports(module: str, everywhere: bool = False) -> tuple[set[str], set[str], list[str]]:
    """``(package modules, third-party top-level names, private names from other package modules)`` of the
    module-level imports (``everywhere``: of every import in the module)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    internal: set[str] = set()
    external: set[str] = set()
    private: list[str] = []
    tree = _tree(module)
    for node in _anywhere(tree) if everywhere else _module_level(tree.body):
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
ALL_GRAPH = {module: _imports(module, everywhere=True)[0] for module in MODULES}


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


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The import cycles of ``graph`` (module -> modules it imports): its strongly connected components of more than
    one module (or a module importing itself), sorted by their smallest module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(module: str) -> None:  # Tarjan's algorithm
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = set(stack[stack.index(module) :])
            del stack[stack.index(module) :]
            if len(component) > 1 or module in graph.get(module, ()):
                found.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found, key=min)


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"e"}, "f": {"g"}, "g": set()}
    assert _cycles(graph) == [{"a", "b", "c"}, {"e"}]
    assert _cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_in_function_imports_are_in_the_full_graph() -> None:
    """The Triton re-fit engine is imported inside ``refit_engine_class`` (triton is optional): an edge of
    ``ALL_GRAPH`` only."""
    backends = f"{PACKAGE}.core.backends"
    assert f"{backends}.refit_lazy_triton" in ALL_GRAPH[backends]
    assert f"{backends}.refit_lazy_triton" not in GRAPH[backends][0]
    assert GRAPH[backends][0] <= ALL_GRAPH[backends]


def test_no_import_cycle() -> None:
    cycles = _cycles({module: internal for module, (internal, _, _) in GRAPH.items()})
    assert cycles == [], f"import cycles: {cycles}"


def test_no_import_cycle_through_imports_inside_functions() -> None:
    """Imports inside functions are for optional packages; none may close a cycle among the package's modules (as
    refit_lazy -> refit_lazy_triton -> refit_triton -> refit_lazy and llm.io.readers <-> llm.models once did)."""
    cycles = _cycles(ALL_GRAPH)
    assert cycles == [], f"import cycles (imports inside functions included): {cycles}"


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
    assert not [t for t in imports(f"{PACKAGE}.llm") if t.startswith(f"{PACKAGE}.callbacks")]
    # the pruning pipeline needs no fine-tuning; the job alone runs PERP after it (finetune_steps), through the
    # training loop only
    tuning = {m: [t for t in internal if t.startswith(f"{PACKAGE}.finetune")] for m, (internal, _, _) in GRAPH.items()}
    assert {m: t for m, t in tuning.items() if t and m.startswith(f"{PACKAGE}.llm")} == {
        f"{PACKAGE}.llm.job": [f"{PACKAGE}.finetune.train"]
    }


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
