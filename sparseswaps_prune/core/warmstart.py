"""Warmstart masks: one scoring path (magnitude | wanda | ria) feeding one selection path, plus SparseGPT.

Selection keeps the highest scores: per row (every row keeps the same count), per layer (one
threshold over the whole matrix) or N:M (``n`` of every ``m`` consecutive inputs of each row).
Ties are broken deterministically by a stable sort: among equal scores the lower index is kept.
The ``sparsegpt`` warmstart is SparseGPT's own mask (its per-block OBS selection, which scores each block
on weights already updated by the blocks before it), with the original weights kept (mask only).
"""

from __future__ import annotations

from typing import Literal

import torch

from sparseswaps_prune.core.checks import check_budget, check_gram, check_weight, kept_per_row

SCORES = ("magnitude", "wanda", "ria")
WARMSTARTS = (*SCORES, "sparsegpt")
Scope = Literal["row", "layer"]


def importance_scores(
    weight: torch.Tensor, method: str, gram: torch.Tensor | None = None, *, ria_alpha: float = 0.5
) -> torch.Tensor:
    """Saliency of every weight, ``[d_out, d_in]`` float32 (higher = more important).

    * ``magnitude``: ``|W_ij|``.
    * ``wanda``: ``|W_ij| * ||X_j||_2 = |W_ij| * sqrt(G_jj)`` (Sun et al. 2023).
    * ``ria``: ``(|W_ij| / sum_i |W_ij| + |W_ij| / sum_j |W_ij|) * sqrt(G_jj) ** ria_alpha``
      (relative importance and activations, Zhang et al. 2024, ``alpha = 0.5``).

    Only the diagonal of ``gram`` is used. ``weight`` and ``gram`` are not modified.
    """
    if method not in SCORES:
        raise ValueError(f"unknown importance score {method!r}; choose one of {', '.join(SCORES)}")
    check_weight(weight)
    magnitude = weight.detach().abs().to(torch.float32)
    if method == "magnitude":
        return magnitude
    if gram is None:
        raise ValueError(
            f"warmstart {method!r} needs the layer's input Gram matrix (gram=, [d_in, d_in]; only its "
            "diagonal is used); accumulate it with GramAccumulator or use warmstart='magnitude'"
        )
    check_gram(gram, weight.shape[1])
    feature_norm = torch.diagonal(gram).to(device=weight.device, dtype=torch.float32).clamp_min(0).sqrt()
    if method == "wanda":
        return magnitude * feature_norm
    eps = torch.finfo(torch.float32).tiny
    relative = magnitude / magnitude.sum(dim=0, keepdim=True).clamp_min(eps)
    relative = relative + magnitude / magnitude.sum(dim=1, keepdim=True).clamp_min(eps)
    return relative * feature_norm.pow(ria_alpha)


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
    d_out, d_in = scores.shape
    check_budget(sparsity, nm, d_in)
    if nm is not None:
        n, m = nm
        blocks = scores.reshape(d_out, d_in // m, m)
        return keep_top(blocks, n).reshape(d_out, d_in)
    if scope == "row":
        return keep_top(scores, kept_per_row(sparsity, d_in))
    return keep_top(scores.reshape(1, -1), kept_per_row(sparsity, scores.numel())).reshape(d_out, d_in)


def keep_top(scores: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """Bool mask of the ``k`` largest entries along the last dim (``k`` an int, or a tensor broadcasting
    against ``scores[..., :1]`` for per-row counts); stable, so among equal scores the lower index is kept."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    position = torch.arange(scores.shape[-1], device=scores.device).expand_as(scores)
    keep = torch.zeros_like(scores, dtype=torch.bool)
    return keep.scatter_(-1, order, position < k)


def warmstart_mask(
    weight: torch.Tensor,
    method: str,
    *,
    sparsity: float | None = None,
    nm: tuple[int, int] | None = None,
    gram: torch.Tensor | None = None,
    scope: Scope = "row",
) -> torch.Tensor:
    """Warmstart mask for a linear layer.

    Args:
        weight: ``[d_out, d_in]`` float tensor (not modified).
        method: ``"magnitude"``, ``"wanda"``, ``"ria"`` or ``"sparsegpt"`` (all but magnitude need ``gram``).
        sparsity: fraction of weights pruned, in ``[0, 1)``; exclusive with ``nm``.
        nm: ``(n, m)``: keep ``n`` of every ``m`` consecutive inputs of each row, e.g. ``(2, 4)``.
        gram: ``[d_in, d_in]`` Gram matrix of the layer inputs.
        scope: ``"row"`` (same count per row, what SparseSwaps refines) or ``"layer"``.

    Returns:
        ``[d_out, d_in]`` bool tensor on ``weight``'s device, True = kept.

    Example:
        >>> mask = warmstart_mask(layer.weight, "wanda", sparsity=0.6, gram=acc.gram)
    """
    check_weight(weight)
    check_budget(sparsity, nm, weight.shape[1])
    if method == "sparsegpt":
        if gram is None:
            raise ValueError("warmstart 'sparsegpt' needs the layer's input Gram matrix (gram=, [d_in, d_in])")
        from sparseswaps_prune.core.sparsegpt import sparsegpt_prune  # imports keep_top from this module

        return sparsegpt_prune(weight, gram, sparsity=sparsity, nm=nm, scope=scope, update_weights=False).keep_mask
    return select_mask(importance_scores(weight, method, gram), sparsity=sparsity, nm=nm, scope=scope)
