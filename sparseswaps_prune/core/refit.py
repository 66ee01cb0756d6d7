"""Re-fit the kept weights of a pruned layer by per-row least squares on the calibration Gram.

Two solvers for the same problem: ``"direct"`` (batched float64 Cholesky of every row's ``G_SS``, exact,
``O(k^3)`` per row) and ``"cg"`` (batched Jacobi-preconditioned conjugate gradients, warm-started from the
kept original weights; one ``[rows, d_in] @ [d_in, d_in]`` product per step shares ``G`` across all rows,
so wide layers such as a 14336-input ``down_proj`` stay cheap). The kept-set Cholesky of the direct solver,
:func:`~sparseswaps_prune.core.backends.refit_state.factor_kept`, is shared with the re-fit objective's swap state
and lives with it among the backends (importable from here too).
"""

from __future__ import annotations

import torch

from sparseswaps_prune.core.backends.refit_state import factor_kept
from sparseswaps_prune.core.checks import check_gram, check_int, check_mask, check_number, check_weight

# Elements of the [rows, k, k] systems solved at once when the caller gives no row_batch (16 MiB float64). Small
# batches reuse the allocator's memory: with 256 MiB batches the fresh pages of the gathered systems and of the
# factor cost as much as the Cholesky itself on the 2-core AMD host of BENCHMARKS.md (LS re-fit of a 1536 x 576 layer
# 1.28 s -> 1.03 s, of a 576 x 1536 layer 4.24 s -> 2.89 s at 2^21; identical results, each row is solved alone).
SYSTEM_ELEMENTS = 1 << 21
# Default relative dampening of the re-fit. LLM activations have a few outlier features that dominate
# mean(diag G), so lambda = 0.01 * mean(diag G) already shrinks the re-fit hard: on SmolLM2's layers 1e-2 gives
# about 1.5x the held-out loss of 1e-3 to 1e-5 (RESULTS.md, benchmarks/layer_study.py).
REFIT_DAMP = 1e-3
# The two ridges of the re-fit (see refit_weights): "mean" is ours, "diag" the problem ADMM's and ALPS's weight
# updates solve on a fixed mask (their Gram normalised by sqrt(diag G), ridge damp * its unit mean diagonal).
RIDGES = ("mean", "diag")
# Default relative ridge per kind: "diag" takes ADMM's percdamp (Boza 2024), the stronger of the two originals'.
RIDGE_DAMPS = {"mean": REFIT_DAMP, "diag": 0.1}
REFIT_RIDGE = "diag"
"""The re-fit's default ridge (of :func:`refit_weights`, ``refine_mask(objective="refit")`` and the least-squares
stage): least squares on ``G + 0.1 diag(G)``, the problem ADMM's and ALPS's weight updates solve."""


def damping(gram64: torch.Tensor, damp: float, ridge: str = "mean") -> float | torch.Tensor:
    """Absolute damping of the relative ``damp`` (``gram64``: ``[d, d]``): ``ridge="mean"``: the float
    ``lambda = damp * mean(diag G)``; ``ridge="diag"``: ``[d]`` float64 ``lambda_j = damp * G_jj``."""
    if ridge == "diag":
        return damp * torch.diagonal(gram64).clone()
    return damp * float(torch.diagonal(gram64).mean())


def refit_weights(
    weight: torch.Tensor,
    gram: torch.Tensor,
    keep_mask: torch.Tensor,
    *,
    damp: float | None = None,
    ridge: str = REFIT_RIDGE,
    row_batch: int | None = None,
    solver: str = "direct",
    max_steps: int = 200,
    tol: float = 1e-6,
) -> torch.Tensor:
    """Best weights on each row's kept set: ``argmin_v (w - v)^T G (w - v)`` with ``v`` zero off the mask.

    Two ridges, batched over rows; rows may keep different counts (per-layer or SparseGPT masks):

    * ``ridge="mean"``: every row solves ``(G_SS + lambda I) v_S = (G w)_S`` with ``lambda = damp * mean(diag G)``
      (the ridge problem ``min (w - v)^T G (w - v) + lambda ||v||^2``, shrinking towards zero);
    * ``ridge="diag"``: ``(G_SS + D_S) v_S = ((G + D) w)_S`` with ``D = damp * diag(G)``, i.e. exact least
      squares on the damped Gram, ``min (w - v)^T (G + D) (w - v)``, shrinking each kept weight towards its dense
      value in proportion to its input's energy. This is the fixed-mask problem that ADMM's and ALPS's updates
      iterate towards (their ridge on the Gram normalised by ``sqrt(diag G)``); ``admm_update`` with many
      iterations converges to it.

    ``solver="direct"`` factorizes every ``G_SS`` in float64;
    ``solver="cg"`` runs conjugate gradients in float64 until every row's residual norm is below ``tol``
    times its right-hand side's norm, or ``max_steps`` steps.

    Args:
        weight: ``[d_out, d_in]`` float tensor (not modified).
        gram: ``[d_in, d_in]`` Gram matrix of the layer inputs (not modified).
        keep_mask: ``[d_out, d_in]`` bool, True = kept (not modified).
        damp: relative dampening (0 allowed when every ``G_SS`` is positive definite); default
            ``RIDGE_DAMPS[ridge]`` (1e-3 for ``"mean"``, ADMM's 0.1 for ``"diag"``).
        ridge: ``"mean"`` or ``"diag"`` (above; default :data:`REFIT_RIDGE`, ``"diag"``).
        row_batch: rows solved together (default bounds the ``[rows, k, k]`` systems to ~16 MiB for
            ``"direct"``; all rows at once for ``"cg"``).
        solver: ``"direct"`` or ``"cg"``.
        max_steps, tol: conjugate-gradient stopping rule (``"cg"`` only).

    Returns:
        ``[d_out, d_in]`` tensor of ``weight``'s dtype and device, exactly zero where ``keep_mask`` is False.

    Raises:
        ValueError / TypeError: bad shapes, NaN, ``damp`` not a number ``>= 0``, ``row_batch`` not an int ``>= 1``,
            an unknown ``solver``, or (``"direct"``) a singular ``G_SS + lambda I`` (names the rows; raise ``damp``).
    """
    check_weight(weight)
    d_out, d_in = weight.shape
    check_gram(gram, d_in)
    check_mask(keep_mask, weight)
    if ridge not in RIDGES:
        raise ValueError(f"ridge must be 'mean' or 'diag', got {ridge!r}")
    damp = RIDGE_DAMPS[ridge] if damp is None else damp
    check_number(damp, "damp", low=0)
    if row_batch is not None:
        check_int(row_batch, "row_batch", low=1)
    if solver not in ("direct", "cg"):
        raise ValueError(f"solver must be 'direct' or 'cg', got {solver!r}")
    gram64 = gram.detach().to(device=weight.device, dtype=torch.float64)
    lam = damping(gram64, damp, ridge)
    target = weight.detach().to(torch.float64) @ gram64  # (G w)_j for every row, G symmetric
    if ridge == "diag":
        target += lam * weight.detach().to(torch.float64)  # ((G + D) w)_j
    if solver == "cg":
        return _refit_cg(weight, gram64, keep_mask.to(weight.device), target, lam, max_steps, tol).to(weight.dtype)
    out = torch.zeros_like(weight)
    keep_mask = keep_mask.to(weight.device)
    counts = keep_mask.sum(dim=1)
    # Rows in descending order of their kept counts (stable: equal counts keep their order), batched so that each
    # batch is padded only to its own largest count: with per-layer masks a few rows keep far more inputs than
    # the rest, and padding every row to the layer's largest count costs up to (k_max / k)^3 more.
    by_count = torch.sort(counts, descending=True, stable=True).indices
    start = 0
    while start < d_out:
        k_batch = int(counts[by_count[start]])
        if k_batch == 0:
            break  # the remaining rows keep nothing: their weights stay zero
        batch = row_batch or max(1, SYSTEM_ELEMENTS // (k_batch * k_batch))
        rows = by_count[start : start + batch]
        start += rows.numel()
        keep = keep_mask[rows]
        order, valid, factor = factor_kept(gram64, keep, lam, k_batch, row_offset=rows)
        rhs = torch.where(valid, target[rows].gather(1, order), 0.0)  # spare slots: identity system, zero target
        # two triangular solves: ~10x faster than batched cholesky_solve with one right-hand side on CPU
        half = torch.linalg.solve_triangular(factor, rhs[:, :, None], upper=False)
        solution = torch.linalg.solve_triangular(factor.mT, half, upper=True).squeeze(2)
        out[rows] = (
            torch.zeros(keep.shape, dtype=torch.float64, device=weight.device)
            .scatter(1, order, torch.where(valid, solution, 0.0))
            .to(weight.dtype)
        )
    return out


def _refit_cg(
    weight: torch.Tensor,
    gram64: torch.Tensor,
    keep: torch.Tensor,
    target: torch.Tensor,
    lam: float | torch.Tensor,
    max_steps: int,
    tol: float,
) -> torch.Tensor:
    """Batched Jacobi-preconditioned CG on ``(G_SS + diag(lam)_S) v_S = target_S`` for every row (``lam`` a
    float or ``[d_in]``); float64 ``[d_out, d_in]``, zero off ``keep``. Starts from the kept original weights."""

    def apply(v: torch.Tensor) -> torch.Tensor:  # (G_SS + lam I) v_S, zero off the mask
        return torch.where(keep, v @ gram64 + lam * v, 0.0)

    diag = torch.diagonal(gram64) + lam
    if bool((diag[None, :].expand_as(keep)[keep] <= 0).any()):
        raise ValueError("a kept input has no calibration signal (G_jj = 0); use damp > 0 (got damp=0)")
    inv_diag = torch.where(keep, 1.0 / diag.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    rhs = torch.where(keep, target, 0.0)
    v = torch.where(keep, weight.detach().to(torch.float64), 0.0)
    residual = rhs - apply(v)
    z = inv_diag * residual
    direction = z.clone()
    rz = (residual * z).sum(dim=1)
    limit = tol * rhs.norm(dim=1)
    for _ in range(max_steps):
        active = residual.norm(dim=1) > limit
        if not bool(active.any()):
            break
        product = apply(direction)
        curvature = (direction * product).sum(dim=1)
        alpha = torch.where(active & (curvature > 0), rz / curvature.clamp_min(1e-300), 0.0)
        v += alpha[:, None] * direction
        residual -= alpha[:, None] * product
        z = inv_diag * residual
        rz_next = (residual * z).sum(dim=1)
        beta = torch.where(rz > 0, rz_next / rz.clamp_min(1e-300), 0.0)
        direction = z + beta[:, None] * direction
        rz = rz_next
    return v
