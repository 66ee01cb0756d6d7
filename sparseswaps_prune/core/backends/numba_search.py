"""Compiled CPU best-swap search (numba, parallel over blocks of rows).

For a block of rows, each row ``u`` of ``G`` is read once and reused by every row of the block whose
weight ``u`` is kept; the inner loop over ``p`` is a branch-free ``min`` that the compiler vectorizes.
A Cauchy-Schwarz lower bound ``A_u + min_p B_p - 2 |w_u| sqrt(G_uu) max_p |w_p| sqrt(G_pp)`` (with a
rounding margin) skips every ``u`` that cannot beat the row's best swap so far, without changing the
result. The argmin ``p`` is recovered only for each row's winning ``u``.
"""

from __future__ import annotations

import numba as nb
import numpy as np
import torch

ROW_BLOCK = 16


@nb.njit(fastmath=True, cache=True)
def _pair_min(restore, cross_u, gram_u, restore_weight):  # pragma: no cover - compiled
    best = np.inf
    for p in range(restore.shape[0]):
        best = min(best, restore[p] + cross_u * (gram_u[p] * restore_weight[p]))
    return best


@nb.njit(cache=True)
def _pair_argmin(restore, cross_u, gram_u, restore_weight):  # pragma: no cover - compiled
    best, best_p = np.inf, 0
    for p in range(restore.shape[0]):
        value = restore[p] + cross_u * (gram_u[p] * restore_weight[p])
        if value < best:
            best, best_p = value, p
    return best, best_p


@nb.njit(parallel=True, cache=True)
def _search(weight, keep, corr, gram, row_block, margin, out_u, out_p, out_dl):  # pragma: no cover
    rows, d = weight.shape
    n_blocks = (rows + row_block - 1) // row_block
    for b in nb.prange(n_blocks):
        r0 = b * row_block
        nr = min(rows, r0 + row_block) - r0
        remove = np.full((nr, d), np.inf, weight.dtype)
        restore = np.full((nr, d), np.inf, weight.dtype)
        cross = np.zeros((nr, d), weight.dtype)
        restore_weight = np.zeros((nr, d), weight.dtype)
        bound = np.full((nr, d), np.inf, weight.dtype)
        best = np.full(nr, np.inf, weight.dtype)
        best_u = np.zeros(nr, np.int64)
        for i in range(nr):
            r = r0 + i
            min_restore, max_scale, first_u = np.inf, 0.0, -1
            for j in range(d):
                w, g = weight[r, j], gram[j, j]
                if keep[r, j]:
                    remove[i, j] = 2 * w * corr[r, j] + w * w * g
                    cross[i, j] = -2 * w
                    if first_u < 0 or remove[i, j] < remove[i, first_u]:
                        first_u = j
                elif w != 0:  # exact zeros are never restored (see terms.swap_terms)
                    restore[i, j] = w * w * g - 2 * w * corr[r, j]
                    restore_weight[i, j] = w
                    min_restore = min(min_restore, restore[i, j])
                    max_scale = max(max_scale, abs(w) * np.sqrt(max(g, 0.0)))
            if first_u < 0 or min_restore == np.inf:
                continue  # no kept or no pruned weight: no feasible swap
            for j in range(d):
                if keep[r, j]:
                    a = remove[i, j]
                    interaction = 2 * abs(weight[r, j]) * np.sqrt(max(gram[j, j], 0.0)) * max_scale
                    bound[i, j] = a + min_restore - interaction - margin * (abs(a) + abs(min_restore) + interaction)
            # Seed the row's best with its cheapest removal so the bound can skip from the start.
            best[i] = remove[i, first_u] + _pair_min(restore[i], cross[i, first_u], gram[first_u], restore_weight[i])
            best_u[i] = first_u
        for u in range(d):
            gram_u = gram[u]
            for i in range(nr):
                if bound[i, u] <= best[i]:
                    total = remove[i, u] + _pair_min(restore[i], cross[i, u], gram_u, restore_weight[i])
                    if total < best[i] or (total == best[i] and u < best_u[i]):
                        best[i], best_u[i] = total, u
        for i in range(nr):
            r = r0 + i
            out_dl[r] = np.inf
            if best[i] < np.inf:
                u = best_u[i]
                value, p = _pair_argmin(restore[i], cross[i, u], gram[u], restore_weight[i])
                out_u[r], out_p[r], out_dl[r] = u, p, remove[i, u] + value


def best_swaps_numba(
    weight: torch.Tensor, keep: torch.Tensor, corr: torch.Tensor, gram: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best per-row 1-swap on the CPU; same contract and tie rule as ``best_swaps_torch``.

    ``weight``, ``corr`` ``[rows, d]`` and ``gram`` ``[d, d]`` share one dtype (float32 or float64);
    ``keep`` is bool ``[rows, d]``. Inputs are not modified.
    """
    if weight.device.type != "cpu":
        raise ValueError(f"the numba backend runs on the CPU; got tensors on {weight.device}")
    dtype = weight.dtype
    as_np = lambda t: t.detach().to(dtype).contiguous().numpy()  # noqa: E731
    rows = weight.shape[0]
    out_u = np.zeros(rows, np.int64)
    out_p = np.zeros(rows, np.int64)
    out_dl = np.empty(rows, as_np(weight[:0]).dtype)
    margin = 64 * torch.finfo(dtype).eps
    _search(
        as_np(weight),
        keep.contiguous().numpy(),
        as_np(corr),
        as_np(gram),
        ROW_BLOCK,
        margin,
        out_u,
        out_p,
        out_dl,
    )
    return torch.from_numpy(out_u), torch.from_numpy(out_p), torch.from_numpy(out_dl)
