"""Per-row layer loss ``L_i = r_i^T G r_i`` with ``r_i = w_i * (1 - m_i)`` (or ``r_i = w_i - w'_i`` for
re-fitted weights ``w'``) and the correlation vector ``c_i = G r_i``."""

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
    residual = weight.to(torch.float64) - pruned_weight.to(device=weight.device, dtype=torch.float64)
    return ((residual @ gram.to(device=weight.device, dtype=torch.float64)) * residual).sum(dim=1)
