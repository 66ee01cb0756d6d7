"""Compiled CPU best-swap search (numba, parallel over blocks of rows).

For a block of rows, each row ``u`` of ``G`` is read once and reused by every row of the block whose
weight ``u`` is kept. The inner loop over ``p`` is two vectorized passes: the pair costs (computed
exactly as the torch backend does, no fused multiply-add), then a min over order-preserving integer
keys (numba does not vectorize a float min-reduction). A lower bound on each ``u``'s best ``dL``
(exact against the pruned weights of largest ``|w_p| sqrt(G_pp)``, Cauchy-Schwarz
``|G_up| <= sqrt(G_uu G_pp)`` for the rest, with a rounding margin) skips every ``u`` that cannot beat
the row's best swap, without changing the result. The argmin ``p`` is recovered only for each row's
winning ``u``.
"""

from __future__ import annotations

import numba as nb
import numpy as np
import torch

ROW_BLOCK = 16
# Pruned weights per row checked exactly inside the lower bound (the largest |w_p| sqrt(G_pp)).
EXACT_TOP = 16


@nb.njit(cache=True)
def _min_key32(bits):  # pragma: no cover - compiled
    """Smallest float32 (given as its int32 bits) by an order-preserving integer key: vectorizes, unlike a
    float min-reduction in numba."""
    best = np.int32(0x7FFFFFFF)
    for p in range(bits.shape[0]):
        b = bits[p]
        key = b ^ ((b >> 31) & np.int32(0x7FFFFFFF))
        best = key if key < best else best
    out = np.empty(1, np.int32)
    out[0] = best ^ ((best >> 31) & np.int32(0x7FFFFFFF))
    return out.view(np.float32)[0]


@nb.njit(cache=True)
def min_key64(bits):  # pragma: no cover - compiled
    """float64 twin of :func:`_min_key32`."""
    best = np.int64(0x7FFFFFFFFFFFFFFF)
    for p in range(bits.shape[0]):
        b = bits[p]
        key = b ^ ((b >> 63) & np.int64(0x7FFFFFFFFFFFFFFF))
        best = key if key < best else best
    out = np.empty(1, np.int64)
    out[0] = best ^ ((best >> 63) & np.int64(0x7FFFFFFFFFFFFFFF))
    return out.view(np.float64)[0]


@nb.njit(cache=True)
def _pair_min(restore, cross_u, gram_u, restore_weight, scratch):  # pragma: no cover - compiled
    """``min_p restore[p] + cross_u * (gram_u[p] * restore_weight[p])``, evaluated exactly as the torch
    backend does (no fused multiply-add), in two vectorized passes through ``scratch``."""
    for p in range(restore.shape[0]):
        scratch[p] = restore[p] + cross_u * (gram_u[p] * restore_weight[p])
    if scratch.itemsize == 4:
        return np.float64(_min_key32(scratch.view(np.int32)))
    return min_key64(scratch.view(np.int64))


@nb.njit(cache=True)
def _pair_argmin(restore, cross_u, gram_u, restore_weight):  # pragma: no cover - compiled
    best, best_p = np.inf, 0
    for p in range(restore.shape[0]):
        value = restore[p] + cross_u * (gram_u[p] * restore_weight[p])
        if value < best:
            best, best_p = value, p
    return best, best_p


@nb.njit(cache=True)
def _prepare_row(weight, keep, corr, gram, n_exact, margin, remove, restore, cross, restore_weight, scale, bound):
    """Fill one row's swap terms and a lower bound on every kept ``u``'s best ``dL`` (in place).

    The bound evaluates ``u`` exactly against the ``n_exact`` pruned weights of largest
    ``|w_p| sqrt(G_pp)`` and bounds the rest by Cauchy-Schwarz, ``|G_up| <= sqrt(G_uu G_pp)``. Returns a
    cutoff no smaller than the row's optimum (an achievable ``dL`` plus a rounding margin); ``inf`` when
    the row has no feasible swap.
    """  # pragma: no cover - compiled
    d = weight.shape[0]
    n_kept, n_restorable = 0, 0
    for j in range(d):
        w, g = weight[j], gram[j, j]
        remove[j], restore[j], cross[j], restore_weight[j], bound[j], scale[j] = np.inf, np.inf, 0, 0, np.inf, -1
        if keep[j]:
            remove[j] = 2 * w * corr[j] + w * w * g
            cross[j] = -2 * w
            n_kept += 1
        elif w != 0:  # exact zeros are never restored (see terms.swap_terms)
            restore[j] = w * w * g - 2 * w * corr[j]
            restore_weight[j] = w
            scale[j] = abs(w) * np.sqrt(max(g, 0.0))
            n_restorable += 1
    if n_kept == 0 or n_restorable == 0:
        return np.inf
    order = np.argsort(-scale)  # restorable weights first, largest scale first
    k = min(n_exact, n_restorable)
    rest_scale = scale[order[k]] if k < n_restorable else 0.0
    rest_min = np.inf
    for t in range(k, n_restorable):
        rest_min = min(rest_min, restore[order[t]])
    cutoff = np.inf
    for u in range(d):
        if keep[u]:
            a, c = remove[u], cross[u]
            exact = np.inf
            for t in range(k):
                p = order[t]
                exact = min(exact, restore[p] + c * (gram[u, p] * restore_weight[p]))
            if a + exact < np.inf:
                cutoff = min(cutoff, a + exact + margin * (abs(a) + abs(exact)))
            interaction = abs(c) * np.sqrt(max(gram[u, u], 0.0)) * rest_scale
            rest = rest_min - interaction
            lowest = min(exact, rest)
            slack = abs(a) + abs(exact if exact < np.inf else 0.0) + interaction
            slack += abs(rest_min) if rest_min < np.inf else 0.0
            bound[u] = a + lowest - margin * slack
    return cutoff


@nb.njit(parallel=True, cache=True)
def _search(weight, keep, corr, gram, row_block, n_exact, margin, out_u, out_p, out_dl):  # pragma: no cover
    rows, d = weight.shape
    n_blocks = (rows + row_block - 1) // row_block
    for b in nb.prange(n_blocks):
        r0 = b * row_block
        nr = min(rows, r0 + row_block) - r0
        remove = np.empty((nr, d), weight.dtype)
        restore = np.empty((nr, d), weight.dtype)
        cross = np.empty((nr, d), weight.dtype)
        restore_weight = np.empty((nr, d), weight.dtype)
        bound = np.empty((nr, d), weight.dtype)
        scale = np.empty(d, weight.dtype)
        scratch = np.empty(d, weight.dtype)
        cutoff = np.empty(nr, weight.dtype)
        best = np.full(nr, np.inf, weight.dtype)
        best_u = np.zeros(nr, np.int64)
        for i in range(nr):
            r = r0 + i
            cutoff[i] = _prepare_row(
                weight[r], keep[r], corr[r], gram, n_exact, margin,
                remove[i], restore[i], cross[i], restore_weight[i], scale, bound[i],
            )  # fmt: skip
        for u in range(d):  # ascending u with a strict "<": ties keep the smallest u
            gram_u = gram[u]
            for i in range(nr):
                if bound[i, u] <= min(best[i], cutoff[i]):
                    total = remove[i, u] + _pair_min(restore[i], cross[i, u], gram_u, restore_weight[i], scratch)
                    if total < best[i]:
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
        EXACT_TOP,
        margin,
        out_u,
        out_p,
        out_dl,
    )
    return torch.from_numpy(out_u), torch.from_numpy(out_p), torch.from_numpy(out_dl)
