"""Session-wide test setup."""

import os

import torch

# Without a GPU, Triton kernels run in its interpreter on CPU tensors. Triton reads this when it is first
# imported (lightning, transformers and others may import it long before tests/core/test_triton.py), so
# it must be set before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
