"""Session-wide test setup."""

import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

# Without a GPU, Triton kernels run in its interpreter on CPU tensors. Triton reads this when it is first
# imported (lightning, transformers and others may import it long before tests/core/test_triton.py), so
# it must be set before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def benchmark_script() -> Callable[[str], ModuleType]:
    """``benchmark_script("layer_study")`` imports ``benchmarks/layer_study.py`` (the scripts are not a package;
    like ``python benchmarks/x.py``, a script may import its siblings)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
