"""Selection primitives: keep the highest scores under a budget (per row, per layer or N:M).

Ties are broken deterministically by a stable sort: among equal scores the lower index is kept. Every mask
source (score warmstarts, SparseGPT's per-block selection, ADMM, the layer pruning) selects through here.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from sparseswaps_prune.core.checks import check_budget, kept_per_row

Scope = Literal["row", "layer"]


def select_mask(
    scores: torch.Tensor,
    *,
    sparsity: float | None = None,
    nm: tuple[int, int] | None = None,
    scope: Scope = "row",
) -> torch.Tensor:
    """Keep the highest ``scores`` under a budget; returns a bool mask shaped like ``scores`` (True = kept).

    ``scope="row"`` keeps ``d_in - round(sparsity * d_in)`` per row; ``scope="layer"`` keeps
    ``numel - round(sparsity * numel)`` over the matrix; ``nm=(n, m)`` keeps ``n`` per block of ``m``
    (``scope`` is then irrelevant). Equal scores keep the lower (row-major) index.
    """
    if scope not in ("row", "layer"):
        raise ValueError(f"scope must be 'row' or 'layer', got {scope!r}")
    check_budget(sparsity, nm, scores.shape[1])
    return select_mask_unchecked(scores, sparsity=sparsity, nm=nm, scope=scope)


def select_mask_unchecked(
    scores: torch.Tensor,
    *,
    sparsity: float | None = None,
    nm: tuple[int, int] | None = None,
    scope: Scope = "row",
) -> torch.Tensor:
    """:func:`select_mask` without validating the budget, for callers that already did (``prune_layer``, the
    iterations of ALPS)."""
    d_out, d_in = scores.shape
    if nm is not None:
        n, m = nm
        blocks = scores.reshape(d_out, d_in // m, m)
        return keep_top(blocks, n).reshape(d_out, d_in)
    if scope == "row":
        return keep_top(scores, kept_per_row(sparsity, d_in))
    return keep_top(scores.reshape(1, -1), kept_per_row(sparsity, scores.numel())).reshape(d_out, d_in)


def select_within(
    scores: torch.Tensor, prior: torch.Tensor, sparsity: float, *, fraction: float | None = None
) -> torch.Tensor:
    """Iterative pruning's selection: each row keeps the highest ``scores`` among the entries ``prior`` keeps,
    pruning ``round(sparsity * kept)`` of its ``kept`` ones (``fraction``: ``floor(fraction * kept)`` pruned, at
    most that many, a step of a gradual schedule); the mask is a subset of ``prior``, whatever the budget's scope.

    ``scores`` ``[d_out, d_in]`` and ``prior`` ``[d_out, d_in]`` bool (True = kept; neither modified)."""
    kept = prior.sum(dim=1, keepdim=True)
    pruned = torch.round(sparsity * kept).long()
    if fraction is not None:
        pruned = torch.minimum((fraction * kept.double()).floor().long(), pruned)
    return keep_top(scores.masked_fill(~prior, float("-inf")), kept - pruned) & prior


def keep_top(scores: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """Bool mask of the ``k`` largest entries along the last dim (``k`` an int, or a tensor broadcasting
    against ``scores[..., :1]`` for per-row counts); stable, so among equal scores the lower index is kept.

    ``scores`` ``[..., n]`` (not modified). For float32/float64 scores on the CPU with an int ``k`` the mask is
    found without sorting (:func:`_keep_top_by_threshold`: the k-th largest value by a linear-time partition, then
    ties by index): the same mask as the stable sort in linear time (``tests/core/test_select.py``). NaN scores,
    per-row counts, other dtypes and devices take the sort."""
    n = scores.shape[-1]
    if isinstance(k, int) and scores.device.type == "cpu":
        if scores.dtype in (torch.float32, torch.float64):
            values = scores.detach().contiguous().numpy()
            if not np.isnan(values).any():
                return torch.from_numpy(_keep_top_by_threshold(values, k))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    position = torch.arange(n, device=scores.device).expand_as(scores)
    keep = torch.zeros_like(scores, dtype=torch.bool)
    return keep.scatter_(-1, order, position < k)


def _keep_top_by_threshold(values: np.ndarray, k: int) -> np.ndarray:
    """:func:`keep_top` for an int ``k`` and NaN-free ``values`` ``[..., n]`` (a float array): every entry above the
    k-th largest value ``t`` of its row (``numpy.partition``, introselect), then the lowest-index entries equal to
    ``t`` until ``k`` are kept (what the stable descending sort keeps; ``-0.0 == 0.0`` there as here)."""
    n = values.shape[-1]
    if k <= 0:
        return np.zeros(values.shape, dtype=bool)
    if k >= n:
        return np.ones(values.shape, dtype=bool)
    threshold = np.partition(values, n - k, axis=-1)[..., n - k : n - k + 1]
    keep = values > threshold
    ties = values == threshold
    room = k - keep.sum(axis=-1, keepdims=True)
    if not np.array_equal(ties.sum(axis=-1, keepdims=True), room):  # more ties than room: the lowest indices
        ties &= np.cumsum(ties, axis=-1) <= room
    return keep | ties
