"""Session-wide test setup."""

import os

# Idle OpenMP threads (torch's and numba's) spin by default; with both runtimes in one process on a small
# machine the spinning threads of one slow down the other many times over. Set before either starts.
os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch

# Without a GPU, Triton kernels run in its interpreter on CPU tensors. Triton reads this when it is first
# imported (lightning, transformers and others may import it long before tests/core/test_triton.py), so
# it must be set before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
