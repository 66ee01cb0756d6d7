"""Block-local best-swap search for N:M sparsity: ``u`` and ``p`` in the same block of ``m``."""

from __future__ import annotations

import torch

from sparseswaps_prune.core.backends.terms import swap_terms


def best_swaps_nm(
    weight: torch.Tensor, keep: torch.Tensor, corr: torch.Tensor, gram: torch.Tensor, m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best per-row swap inside blocks of ``m`` consecutive inputs, ``O(d * m)`` work and memory per row.

    Shapes as :func:`~sparseswaps_prune.core.backends.torch_search.best_swaps_torch`. Ties go to the
    smallest ``u`` then ``p`` (row-major order of ``(block, u, p)``).
    """
    rows, d = weight.shape
    n_blocks = d // m
    remove, restore, cross, restore_weight = (
        t.reshape(rows, n_blocks, m) for t in swap_terms(weight, keep, corr, torch.diagonal(gram))
    )
    # [n_blocks, m, m]: the Gram's diagonal blocks, a view ([a, b, i] = gram[i m + a, i m + b] before the permute)
    gram_blocks = gram.reshape(n_blocks, m, n_blocks, m).diagonal(dim1=0, dim2=2).permute(2, 0, 1)
    pair = restore[:, :, None, :] + cross[:, :, :, None] * (gram_blocks[None] * restore_weight[:, :, None, :])
    cost = (remove[:, :, :, None] + pair).reshape(rows, -1)  # flattened (block, u, p)
    best, flat = cost.min(dim=1)
    block, rest = flat // (m * m), flat % (m * m)
    return block * m + rest // m, block * m + rest % m, best
