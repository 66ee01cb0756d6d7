"""Per-row swap terms shared by every backend."""

from __future__ import annotations

import torch


def swap_terms(
    weight: torch.Tensor, keep: torch.Tensor, corr: torch.Tensor, gram_diag: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split ``dL(u, p) = remove_u + restore_p + cross_u * G_up * restore_weight_p``.

    Args:
        weight, corr: ``[..., d]``; keep: ``[..., d]`` bool; gram_diag: ``[d]`` (broadcast).

    Returns:
        ``remove`` (``2 w c + w^2 G_jj`` on kept, ``+inf`` on pruned), ``restore`` (``-2 w c + w^2 G_jj``
        on pruned, ``+inf`` on kept and on exact zeros, which are never restored: keeping a zero weight
        changes nothing and would only hide extra sparsity), ``cross`` (``-2 w`` on kept, 0 on pruned)
        and ``restore_weight`` (``w`` on pruned, 0 on kept), all shaped like ``weight``.
    """
    inf = torch.tensor(float("inf"), dtype=weight.dtype, device=weight.device)
    own = weight * weight * gram_diag
    twice_wc = 2 * weight * corr
    remove = torch.where(keep, twice_wc + own, inf)
    restore = torch.where(keep | (weight == 0), inf, own - twice_wc)
    cross = torch.where(keep, -2 * weight, 0)
    restore_weight = torch.where(keep, 0, weight)
    return remove, restore, cross, restore_weight
