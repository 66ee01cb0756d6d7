"""Re-fit the kept weights of a pruned layer by exact per-row least squares on the calibration Gram."""

from __future__ import annotations

import torch

from sparseswaps_prune.core.checks import check_gram, check_mask, check_weight

# Elements of the [rows, k, k] systems solved at once when the caller gives no row_batch (256 MiB float64).
SYSTEM_ELEMENTS = 1 << 25


def refit_weights(
    weight: torch.Tensor,
    gram: torch.Tensor,
    keep_mask: torch.Tensor,
    *,
    damp: float = 0.01,
    row_batch: int | None = None,
) -> torch.Tensor:
    """Best weights on each row's kept set: ``argmin_v (w - v)^T G (w - v)`` with ``v`` zero off the mask.

    Every row solves ``(G_SS + lambda I) v_S = (G w)_S`` with ``lambda = damp * mean(diag G)``, in
    float64 by Cholesky, batched over rows; rows may keep different counts (per-layer or SparseGPT masks).

    Args:
        weight: ``[d_out, d_in]`` float tensor (not modified).
        gram: ``[d_in, d_in]`` Gram matrix of the layer inputs (not modified).
        keep_mask: ``[d_out, d_in]`` bool, True = kept.
        damp: relative dampening (0 allowed when every ``G_SS`` is positive definite).
        row_batch: rows solved together (default bounds the ``[rows, k, k]`` systems to ~256 MiB).

    Returns:
        ``[d_out, d_in]`` tensor of ``weight``'s dtype and device, exactly zero where ``keep_mask`` is False.

    Raises:
        ValueError: bad shapes, NaN, ``damp < 0``, or a singular ``G_SS`` (names the rows; raise ``damp``).
    """
    check_weight(weight)
    d_out, d_in = weight.shape
    check_gram(gram, d_in)
    check_mask(keep_mask, weight)
    if not damp >= 0:
        raise ValueError(f"damp must be >= 0, got {damp!r}")
    gram64 = gram.detach().to(device=weight.device, dtype=torch.float64)
    lam = damp * float(torch.diagonal(gram64).mean())
    target = weight.detach().to(torch.float64) @ gram64  # (G w)_j for every row, G symmetric
    out = torch.zeros_like(weight)
    k_max = int(keep_mask.sum(dim=1).max()) if d_out else 0
    if k_max == 0:
        return out
    row_batch = row_batch or max(1, SYSTEM_ELEMENTS // (k_max * k_max))
    for r0 in range(0, d_out, row_batch):
        rows = slice(r0, min(d_out, r0 + row_batch))
        keep = keep_mask[rows].to(weight.device)
        counts = keep.sum(dim=1)
        # kept indices first (ascending), padding after; padded slots get an identity system and a zero target
        order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices[:, :k_max]
        valid = torch.arange(k_max, device=weight.device) < counts[:, None]
        system = gram64[order[:, :, None], order[:, None, :]]
        pair_valid = valid[:, :, None] & valid[:, None, :]
        eye = torch.eye(k_max, dtype=torch.float64, device=weight.device)
        system = torch.where(pair_valid, system + lam * eye, eye)
        rhs = torch.where(valid, target[rows].gather(1, order), 0.0)
        factor, info = torch.linalg.cholesky_ex(system)
        if bool((info != 0).any()):
            bad = (torch.nonzero(info).flatten() + r0).tolist()[:5]
            raise ValueError(
                f"G_SS is singular for rows {bad} (kept inputs with no calibration signal or collinear); "
                f"use damp > 0 (got damp={damp})"
            )
        solution = torch.cholesky_solve(rhs[:, :, None], factor).squeeze(2)
        out[rows] = (
            torch.zeros(keep.shape, dtype=torch.float64, device=weight.device)
            .scatter(1, order, torch.where(valid, solution, 0.0))
            .to(weight.dtype)
        )
    return out
