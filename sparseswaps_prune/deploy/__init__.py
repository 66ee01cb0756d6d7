"""Deploying pruned models: sparse checkpoints (smaller on disk) and sparse inference modules (faster on the CPU).

* :func:`save_sparse` / :func:`load_sparse`: a self-contained directory whose weights are a bitmask plus the kept
  values per pruned linear, in safetensors (:mod:`~sparseswaps_prune.deploy.checkpoint` documents the format);
  loading gives back the transformers model bit for bit.
* :func:`sparsify`: swaps a pruned model's linear layers for :class:`SparseLinear` (numba kernels for up to 8
  tokens per call, a dense matmul above) or, for 2:4 models on CUDA, for ``torch.sparse`` semi-structured weights.

See ``docs/deploy.md`` for the figures and the commands that measured them.
"""

from sparseswaps_prune.deploy.checkpoint import (
    SPARSE_FILE,
    SparseSaveReport,
    is_sparse_checkpoint,
    load_sparse,
    read_sparse_state_dict,
    save_sparse,
    write_sparse_files,
)
from sparseswaps_prune.deploy.format import DEFAULT_MIN_SPARSITY
from sparseswaps_prune.deploy.linear import DEFAULT_CROSSOVER, SparseLinear, SparsifyReport, sparsify

__all__ = [
    "DEFAULT_CROSSOVER",
    "DEFAULT_MIN_SPARSITY",
    "SPARSE_FILE",
    "SparseLinear",
    "SparseSaveReport",
    "SparsifyReport",
    "is_sparse_checkpoint",
    "load_sparse",
    "read_sparse_state_dict",
    "save_sparse",
    "sparsify",
    "write_sparse_files",
]
