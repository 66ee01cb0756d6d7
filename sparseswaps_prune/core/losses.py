"""Per-row layer loss ``L_i = r_i^T G r_i`` with ``r_i = w_i * (1 - m_i)`` and its correlation vector."""

from __future__ import annotations

import torch

from sparseswaps_prune.core.checks import check_gram, check_mask, check_weight


def pruned_residual(weight: torch.Tensor, keep_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(1 - m) * w`` as ``dtype``, shape ``[rows, d_in]``: the weights that pruning removes."""
    return torch.where(keep_mask, 0.0, weight.to(dtype))


def correlation(weight: torch.Tensor, gram: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
    """``c_i = G ((1 - m_i) * w_i)`` for every row, ``[rows, d_in]`` in ``gram``'s dtype."""
    return pruned_residual(weight, keep_mask, gram.dtype) @ gram  # G is symmetric


def row_losses(weight: torch.Tensor, gram: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
    """Per-row pruning loss of a mask.

    Args:
        weight: ``[d_out, d_in]`` float tensor (not modified).
        gram: ``[d_in, d_in]`` ``G = sum_t x_t x_t^T`` over calibration tokens.
        keep_mask: ``[d_out, d_in]`` bool, True = kept.

    Returns:
        ``[d_out]`` float64 tensor ``L_i = r_i^T G r_i``, ``r_i = w_i * (1 - m_i)``, accumulated in float64.
    """
    check_weight(weight)
    check_gram(gram, weight.shape[1])
    check_mask(keep_mask, weight)
    gram64 = gram.to(torch.float64)
    residual = pruned_residual(weight, keep_mask, torch.float64)
    return ((residual @ gram64) * residual).sum(dim=1)
