"""Per-row layer loss ``L_i = r_i^T G r_i`` with ``r_i = w_i * (1 - m_i)`` (or ``r_i = w_i - w'_i`` for
re-fitted weights ``w'``), the correlation vector ``c_i = G r_i``, and the exact change of ``L_i`` under a 1-swap."""

from __future__ import annotations

import torch

from sparseswaps_prune.core.checks import check_gram, check_mask, check_weight


def pruned_residual(weight: torch.Tensor, keep_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(1 - m) * w`` as ``dtype``, shape ``[rows, d_in]``: the weights that pruning removes."""
    return torch.where(keep_mask, 0.0, weight.to(dtype))


def correlation(weight: torch.Tensor, gram: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
    """``c_i = G ((1 - m_i) * w_i)`` for every row, ``[rows, d_in]`` in ``gram``'s dtype."""
    return pruned_residual(weight, keep_mask, gram.dtype) @ gram  # G is symmetric


def swap_delta(
    weight: torch.Tensor, corr: torch.Tensor, u: torch.Tensor, p: torch.Tensor, gram: torch.Tensor
) -> torch.Tensor:
    """Exact change of each row's loss when it prunes kept ``u`` and restores pruned ``p``.

    Args:
        weight: ``[rows, d]`` weights; corr: ``[rows, d]`` correlation ``c = G r`` of the current masks;
        u, p: ``[rows]`` int64 inputs (``u`` kept, ``p`` pruned); gram: ``[d, d]``. Use float64 throughout for
            the exact figure the refinement accepts swaps by. Nothing is modified.

    Returns:
        ``[rows]`` ``dL = 2 w_u c_u + w_u^2 G_uu - 2 w_p c_p + w_p^2 G_pp - 2 w_u w_p G_up`` in ``gram``'s dtype.
    """
    rows = torch.arange(weight.shape[0], device=weight.device)
    w_u, w_p, c_u, c_p = weight[rows, u], weight[rows, p], corr[rows, u], corr[rows, p]
    diag = torch.diagonal(gram)
    return 2 * w_u * c_u + w_u * w_u * diag[u] - 2 * w_p * c_p + w_p * w_p * diag[p] - 2 * w_u * w_p * gram[u, p]


def row_losses(weight: torch.Tensor, gram: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
    """Per-row pruning loss of a mask.

    Args:
        weight: ``[d_out, d_in]`` float tensor (not modified).
        gram: ``[d_in, d_in]`` ``G = sum_t x_t x_t^T`` over calibration tokens.
        keep_mask: ``[d_out, d_in]`` bool, True = kept.

    Returns:
        ``[d_out]`` float64 tensor ``L_i = r_i^T G r_i``, ``r_i = w_i * (1 - m_i)``, accumulated in float64.
    """
    check_mask(keep_mask, weight)
    return weight_losses(weight, torch.where(keep_mask, weight, 0), gram)


def weight_losses(weight: torch.Tensor, pruned_weight: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """Per-row loss of replacing ``weight`` by ``pruned_weight`` (e.g. masked and re-fitted).

    Args:
        weight: ``[d_out, d_in]`` dense float tensor (not modified).
        pruned_weight: ``[d_out, d_in]`` float tensor (not modified).
        gram: ``[d_in, d_in]`` Gram matrix of the layer inputs.

    Returns:
        ``[d_out]`` float64 tensor ``r_i^T G r_i`` with ``r_i = w_i - w'_i``, accumulated in float64.
    """
    check_weight(weight)
    check_gram(gram, weight.shape[1])
    if pruned_weight.shape != weight.shape:
        raise ValueError(f"pruned_weight has shape {tuple(pruned_weight.shape)}, expected {tuple(weight.shape)}")
    return weight_losses_unchecked(weight, pruned_weight, gram)


def weight_losses_unchecked(weight: torch.Tensor, pruned_weight: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """:func:`weight_losses` without validating its inputs, for callers that already did (the Gram check reads
    all of ``G``)."""
    residual = weight.to(torch.float64) - pruned_weight.to(device=weight.device, dtype=torch.float64)
    return ((residual @ gram.to(device=weight.device, dtype=torch.float64)) * residual).sum(dim=1)
