"""Fixtures for the tests of the benchmark scripts in ``benchmarks/`` (not a package)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _exec_script(name: str, module_name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def benchmark_script() -> Callable[[str], ModuleType]:
    """``benchmark_script("layer_study")`` imports ``benchmarks/layer_study.py`` as ``layer_study_benchmark``.

    Run as ``python benchmarks/x.py``, a script finds its shared helpers by ``import common`` (the script's
    directory is on ``sys.path``). Here ``benchmarks/common.py`` is registered as ``common`` only while the
    script executes, so neither ``benchmarks/`` on ``sys.path`` nor a module named ``common`` outlives the load.
    """
    common = _exec_script("common", "common")

    def load(name: str) -> ModuleType:
        previous = sys.modules.get("common")
        sys.modules["common"] = common
        try:
            return _exec_script(name, f"{name}_benchmark")
        finally:
            if previous is None:
                del sys.modules["common"]
            else:
                sys.modules["common"] = previous

    return load
