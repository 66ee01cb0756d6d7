"""SparseSwaps under the re-fit objective: a swap is judged by the loss after re-fitting the kept weights.

For a row ``w`` with kept set ``S`` the re-fitted weights (as :func:`~sparseswaps_prune.core.refit.refit_weights`)
are ``v = argmin_v (w - v)^T G (w - v) + lambda ||v||^2`` over ``v`` zero off ``S``, ``lambda = damp * mean(diag G)``.
The search minimises the value of that problem, the *damped re-fit objective*

    F(S) = w^T G w - b_S^T H b_S,   b = G w,   H = (G_SS + lambda I)^{-1}

(``damp = 0`` gives the plain least-squares loss ``(w - v)^T G (w - v)``). Per row the state is kept in float64:
``H``, ``v = H b_S``, the residual ``r = b - G v`` and, for every pruned ``p``, ``Z[:, p] = H G[S, p]`` and the
Schur complement ``s_p = G_pp + lambda - G[p, S] Z[:, p]``. Then, exactly,

* removing kept ``u`` changes ``F`` by ``v_u^2 / H_uu``;
* restoring pruned ``p`` changes ``F`` by ``-r_p^2 / s_p``;
* the swap (prune ``u``, restore ``p``) changes ``F`` by
  ``v_u^2 / H_uu - (r_p + Z_up v_u / H_uu)^2 / (s_p + Z_up^2 / H_uu)``.

After a swap ``H``, ``v``, ``r``, ``s`` and ``Z`` change by two rank-one updates (the removal is a downdate of
``H``; the addition a block-inverse update with ``s_p``), ``O(k (d_in - k) + k^2)`` per row, no re-inversion; the
state is rebuilt from scratch (Cholesky) every ``resync_every`` iterations.

Slots: each row holds its kept inputs in ``K`` kept slots and its pruned inputs in ``Q`` pruned slots (vacant slots
pad rows with fewer inputs; their entries of ``H``, ``v``, ``Z`` are zero). A swap puts ``p`` into ``u``'s kept slot
and ``u`` into ``p``'s pruned slot, so slot order is arbitrary; ties are still broken by input index.

Pruned weights that are exactly zero are never restored (as in the mask-only search), and a restore whose new pivot
``s`` would fall below ``PIVOT_RTOL * (G_pp + lambda)`` (a kept set whose ``G_SS + lambda I`` is numerically
singular, only possible with ``damp = 0``) is not considered.

The state and its exact updates live among the backends, :mod:`~sparseswaps_prune.core.backends.refit_state` (the
torch reference, and the pieces every engine shares; re-exported here), the engines behind one contract in
:mod:`~sparseswaps_prune.core.backends.refit_engine`; the iteration loop that drives them (both scopes) is
:mod:`~sparseswaps_prune.core.refine`. This module holds the defaults of the state's row batches and
:func:`refit_objective`.
"""

from __future__ import annotations

import torch

from sparseswaps_prune.core.backends.refit_state import (  # re-exported: the state's names, importable from here
    ACCEPT_RTOL,
    PIVOT_RTOL,
    SCAN_ELEMENTS,
    SKIP_RTOL,
    Incoming,
    RefitState,
    add_outer,
    add_pruned,
    add_rows,
    best_additions,
    best_removals,
    build_state,
    factor_kept,
    fitted_weights,
    grow,
    inv_column,
    keep_of,
    no_swaps,
    pair_costs,
    pivot_floor,
    place_pruned,
    pruned_slots,
    removal_terms,
    remove_kept,
    restorable,
    restore_vector,
    scan_swaps,
    swap_slots,
)
from sparseswaps_prune.core.checks import check_gram, check_mask, check_number, check_weight
from sparseswaps_prune.core.refit import REFIT_DAMP, damping

__all__ = [
    "ACCEPT_RTOL",
    "PIVOT_RTOL",
    "REFIT_CUDA_FRACTION",
    "REFIT_ELEMENTS",
    "SCAN_ELEMENTS",
    "SKIP_RTOL",
    "Incoming",
    "RefitState",
    "add_outer",
    "add_pruned",
    "add_rows",
    "best_additions",
    "best_removals",
    "build_state",
    "factor_kept",
    "fitted_weights",
    "grow",
    "inv_column",
    "keep_of",
    "no_swaps",
    "pair_costs",
    "pivot_floor",
    "place_pruned",
    "pruned_slots",
    "refit_objective",
    "removal_terms",
    "remove_kept",
    "restorable",
    "restore_vector",
    "scan_swaps",
    "swap_slots",
]

# Elements of the [rows, k, d_in - k] state Z per row batch when the caller gives no row_batch (128 MiB float64).
REFIT_ELEMENTS = 1 << 24
# On CUDA the default row batch's Z may take this fraction of the device's memory: an iteration has a fixed cost of
# a few milliseconds (launches, one host sync), so small batches leave the GPU idle (BENCHMARKS.md, "GPU").
REFIT_CUDA_FRACTION = 1 / 32


def refit_objective(
    weight: torch.Tensor, gram: torch.Tensor, keep_mask: torch.Tensor, *, damp: float = REFIT_DAMP
) -> torch.Tensor:
    """Per-row damped re-fit objective ``F(S) = w^T G w - b_S^T (G_SS + lambda I)^{-1} b_S``, from scratch.

    Args:
        weight: ``[d_out, d_in]``; gram: ``[d_in, d_in]``; keep_mask: ``[d_out, d_in]`` bool (none modified).
        damp: relative damping, ``lambda = damp * mean(diag G)``.

    Returns:
        ``[d_out]`` float64 on ``weight``'s device: ``min_v (w - v)^T G (w - v) + lambda ||v||^2`` over ``v`` zero
        off the mask, what ``refine_mask(..., objective="refit", damp=damp)`` minimises.

    Raises:
        ValueError: bad shapes, NaN, ``damp < 0``, or a singular ``G_SS + lambda I`` (names the rows).
    """
    check_weight(weight)
    check_gram(gram, weight.shape[1])
    check_mask(keep_mask, weight)
    check_number(damp, "damp", low=0)
    gram64 = gram.detach().to(device=weight.device, dtype=torch.float64)
    w64 = weight.detach().to(torch.float64)
    keep = keep_mask.to(weight.device)
    counts = keep.sum(dim=1)
    k_slots = int(counts.max()) if counts.numel() else 0
    state = build_state(w64, keep, gram64, damping(gram64, damp), k_slots, 0)
    target = w64 @ gram64
    kept_target = torch.where(state.kept_ok, target.gather(1, state.kept), 0.0)
    return (target * w64).sum(dim=1) - (kept_target * state.coef).sum(dim=1)
