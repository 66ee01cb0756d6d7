"""Vectorized best-swap search in plain torch (any device); the reference for the compiled kernels."""

from __future__ import annotations

import torch

from sparseswaps_prune.core.backends.terms import swap_terms

# Elements of the [rows, u_chunk, d_in] cost block materialised at once (256 MiB in float32).
CHUNK_ELEMENTS = 1 << 26


def best_swaps_torch(
    weight: torch.Tensor, keep: torch.Tensor, corr: torch.Tensor, gram: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best per-row 1-swap, evaluating ``dL`` for chunks of ``u`` against all ``p`` at once.

    Shapes: ``weight``, ``corr`` ``[rows, d]``, ``keep`` ``[rows, d]`` bool, ``gram`` ``[d, d]``.
    Returns ``u``, ``p`` int64 ``[rows]`` and ``dL`` ``[rows]`` (``+inf`` where no pair exists).
    Memory: one ``[rows, u_chunk, d]`` block, ``u_chunk = CHUNK_ELEMENTS // (rows * d)``.
    """
    rows, d = weight.shape
    remove, restore, cross, restore_weight = swap_terms(weight, keep, corr, torch.diagonal(gram))
    best = torch.full((rows,), float("inf"), dtype=weight.dtype, device=weight.device)
    best_u = torch.zeros(rows, dtype=torch.long, device=weight.device)
    best_p = torch.zeros_like(best_u)
    u_chunk = max(1, CHUNK_ELEMENTS // max(1, rows * d))
    for u0 in range(0, d, u_chunk):
        u1 = min(d, u0 + u_chunk)
        # cost[r, u, p] = restore[r, p] + cross[r, u] * (G[u, p] * restore_weight[r, p])
        cost = restore[:, None, :] + cross[:, u0:u1, None] * (gram[None, u0:u1, :] * restore_weight[:, None, :])
        pair_min, pair_p = cost.min(dim=2)
        total = remove[:, u0:u1] + pair_min
        chunk_best, chunk_u = total.min(dim=1)
        better = chunk_best < best  # strict: an earlier chunk (smaller u) wins ties
        best = torch.where(better, chunk_best, best)
        best_u = torch.where(better, chunk_u + u0, best_u)
        best_p = torch.where(better, pair_p.gather(1, chunk_u[:, None]).squeeze(1), best_p)
    return best_u, best_p, best
