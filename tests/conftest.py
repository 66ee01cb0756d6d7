"""Session-wide test setup."""

import os

# Idle OpenMP threads (torch's and numba's) spin by default; with both runtimes in one process on a small
# machine the spinning threads of one slow down the other many times over. Set before either starts.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter on CPU tensors. Triton reads this when it is first
# imported (lightning, transformers and others may import it long before tests/core/backends/test_triton.py), so
# it must be set before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def default_lm():
    """``(model, tokenizer)`` of the packaged SmolLM2-135M GGUF, float32, loaded once per session (15-50 s on a
    2-core CPU: transformers parses the GGUF three times). Shared: do not modify it; a test that prunes takes a
    ``copy.deepcopy`` of the model (under a second)."""
    from sparseswaps_prune.llm.models import load_model

    return load_model()
