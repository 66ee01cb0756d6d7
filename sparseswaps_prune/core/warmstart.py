"""Warmstart masks: one scoring path (magnitude | wanda | ria) feeding one selection path, plus SparseGPT.

Selection (:mod:`.select`) keeps the highest scores: per row (every row keeps the same count), per layer
(one threshold over the whole matrix) or N:M (``n`` of every ``m`` consecutive inputs of each row).
Ties are broken deterministically by a stable sort: among equal scores the lower index is kept.
The ``sparsegpt`` warmstart is SparseGPT's own mask (its per-block OBS selection, which scores each block
on weights already updated by the blocks before it), with the original weights kept (mask only).
"""

from __future__ import annotations

import torch

from sparseswaps_prune.core.checks import check_budget, check_gram, check_weight
from sparseswaps_prune.core.select import Scope, select_mask
from sparseswaps_prune.core.sparsegpt import sparsegpt_prune

SCORES = ("magnitude", "wanda", "ria")
WARMSTARTS = (*SCORES, "sparsegpt")


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
    if method != "magnitude":
        if gram is None:
            raise ValueError(
                f"warmstart {method!r} needs the layer's input Gram matrix (gram=, [d_in, d_in]; only its "
                "diagonal is used); accumulate it with GramAccumulator or use warmstart='magnitude'"
            )
        check_gram(gram, weight.shape[1])
    return importance_scores_unchecked(weight, method, gram, ria_alpha=ria_alpha)


def importance_scores_unchecked(
    weight: torch.Tensor, method: str, gram: torch.Tensor | None, *, ria_alpha: float = 0.5
) -> torch.Tensor:
    """:func:`importance_scores` without validating its inputs, for callers that already did (``prune_layer``:
    the Gram check reads all of ``G``)."""
    magnitude = weight.detach().abs().to(torch.float32)
    if method == "magnitude":
        return magnitude
    feature_norm = torch.diagonal(gram).to(device=weight.device, dtype=torch.float32).clamp_min(0).sqrt()
    if method == "wanda":
        return magnitude * feature_norm
    eps = torch.finfo(torch.float32).tiny
    relative = magnitude / magnitude.sum(dim=0, keepdim=True).clamp_min(eps)
    relative = relative + magnitude / magnitude.sum(dim=1, keepdim=True).clamp_min(eps)
    return relative * feature_norm.pow(ria_alpha)


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
        return sparsegpt_prune(weight, gram, sparsity=sparsity, nm=nm, scope=scope, update_weights=False).keep_mask
    return select_mask(importance_scores(weight, method, gram), sparsity=sparsity, nm=nm, scope=scope)
