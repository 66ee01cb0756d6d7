"""SparseSwaps refinement (Algorithm 1 of arXiv 2512.10922), for all rows at once.

Every iteration applies each row's single best 1-swap (prune a kept ``u``, restore a pruned ``p``) when
it lowers that row's loss ``L = r^T G r``, ``r = (1 - m) * w``, by more than ``eps``. The search runs in
the compute dtype (float32 by default) on a backend; the chosen swap's ``dL`` is then re-evaluated in
float64 and the correlation vector ``c = G r`` is kept in float64 (updated by
``c += w_u G[:, u] - w_p G[:, p]`` and rebuilt from scratch every ``resync_every`` iterations), so an
accepted swap never raises the float64 loss.

``objective="refit"`` judges swaps by the loss after re-fitting the kept weights
(:mod:`~sparseswaps_prune.core.refit_swaps`); ``scope="layer"`` conserves the layer's kept count instead of each
row's, adding moves that prune in one row and restore in another (:mod:`~sparseswaps_prune.core.layer_moves`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from sparseswaps_prune.core import layer_moves
from sparseswaps_prune.core import refit_swaps as rs
from sparseswaps_prune.core.backends import best_swaps, resolve_backend
from sparseswaps_prune.core.checks import check_budget, check_gram, check_mask, check_weight
from sparseswaps_prune.core.losses import correlation, row_losses, weight_losses
from sparseswaps_prune.core.refit import REFIT_DAMP

OBJECTIVES = ("mask", "refit")
SCOPES = ("row", "layer")

# Rows per batch when the caller gives none: bounds the [rows, d_in] working set to ~64 MiB per tensor.
ROW_BATCH_ELEMENTS = 1 << 24


@dataclass
class RefineResult:
    """Outcome of :func:`refine_mask`.

    Attributes:
        mask: ``[d_out, d_in]`` bool refined mask (True = kept), on the weight's device.
        loss_before: ``[d_out]`` float64 per-row loss of the input mask.
        loss_after: ``[d_out]`` float64 per-row loss of ``mask``. For ``objective="mask"`` both are
            ``row_losses`` (``r^T G r``, pruned weights zeroed). For ``objective="refit"`` both are the true, undamped
            loss ``(w - v)^T G (w - v)`` of the re-fitted weights ``v = refit_weights(weight, gram, mask, damp=damp)``
            of the input and refined mask; the search minimises the damped objective (``refit_objective``), so with
            ``damp > 0`` a row's undamped loss may in rare cases rise slightly.
        n_swaps: ``[d_out]`` int64 number of moves each row took part in: in-row swaps, and with ``scope="layer"``
            also cross-row moves (counted once in the donor row and once in the receiver row).
        iters: number of iterations that applied at least one move (at most ``max_iters``; with
            ``scope="row"`` this is ``n_swaps.max()``).
        weight: for ``objective="refit"``, the ``[d_out, d_in]`` re-fitted weights of ``mask`` (weight's dtype and
            device, exactly zero where ``mask`` is False); None for ``objective="mask"``.
    """

    mask: torch.Tensor
    loss_before: torch.Tensor
    loss_after: torch.Tensor
    n_swaps: torch.Tensor
    iters: int
    weight: torch.Tensor | None = None

    @property
    def relative_reduction(self) -> float:
        """``1 - sum(loss_after) / sum(loss_before)`` (0 when the input mask had no loss)."""
        before = float(self.loss_before.sum())
        return 0.0 if before <= 0 else 1.0 - float(self.loss_after.sum()) / before


def _losses(weight: torch.Tensor, gram64: torch.Tensor, keep_mask: torch.Tensor) -> torch.Tensor:
    """``row_losses`` on ``gram64``'s device, reusing the float64 Gram (no further d_in x d_in copy); CPU."""
    return row_losses(weight.to(gram64.device), gram64, keep_mask.to(gram64.device)).cpu()


def check_nm_mask(keep_mask: torch.Tensor, nm: tuple[int, int]) -> None:
    """Raise unless every block of ``m`` consecutive inputs in every row keeps exactly ``n``."""
    n, m = nm
    counts = keep_mask.reshape(keep_mask.shape[0], -1, m).sum(dim=-1)
    if not bool((counts == n).all()):
        raise ValueError(
            f"keep_mask does not follow the {n}:{m} pattern (blocks keep between {int(counts.min())} and "
            f"{int(counts.max())} weights); build it with warmstart_mask(..., nm=({n}, {m}))"
        )


def refine_mask(
    weight: torch.Tensor,
    gram: torch.Tensor,
    keep_mask: torch.Tensor,
    *,
    max_iters: int = 100,
    nm: tuple[int, int] | None = None,
    eps: float = 0.0,
    row_batch: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    resync_every: int = 32,
    objective: Literal["mask", "refit"] = "mask",
    damp: float = REFIT_DAMP,
    scope: Literal["row", "layer"] = "row",
) -> RefineResult:
    """Refine a pruning mask by exact, loss-decreasing 1-swaps.

    Args:
        weight: ``[d_out, d_in]`` float tensor (not modified).
        gram: ``[d_in, d_in]`` Gram matrix ``sum_t x_t x_t^T`` of the layer inputs (not modified).
        keep_mask: ``[d_out, d_in]`` bool warmstart mask, True = kept, from any source (per-row or per-layer
            threshold, SparseGPT, ...: rows may keep different counts; not modified).
        max_iters: at most this many iterations, each applying at most one move per row (``T_max``); 0 returns
            the input mask.
        nm: ``(n, m)``: swaps stay inside blocks of ``m`` consecutive inputs; ``keep_mask`` must follow
            the pattern. Not with ``scope="layer"``.
        eps: a move is applied only if it lowers the loss by more than ``eps``; a row stops once its best
            ``dL`` is not below ``-eps``.
        row_batch: rows refined together (bounds memory); default fits ~64 MiB per ``[rows, d_in]``, and for
            ``objective="refit"`` 128 MiB per float64 ``[rows, k, d_in - k]`` (the state ``Z``).
        device: where to compute (default: the weight's device).
        dtype: search dtype of the mask objective, ``torch.float32`` (fast) or ``torch.float64``; the re-fit
            objective always runs in float64.
        backend: swap search of the mask objective: ``"auto"`` (compiled numba kernel on CPU, fused Triton kernel
            on CUDA when triton is installed, torch elsewhere), ``"torch"``, ``"numba"`` or ``"triton"``. The
            re-fit objective uses its own torch search.
        resync_every: rebuild the float64 state (correlation vectors; for the re-fit objective ``H``, ``v``, ``Z``,
            by Cholesky) from scratch every this many iterations.
        objective: ``"mask"``: minimise the loss of the mask with the original weights, ``r^T G r``.
            ``"refit"``: minimise the loss after re-fitting the kept weights, the damped objective
            ``min_v (w - v)^T G (w - v) + lambda ||v||^2`` (see ``refit_objective``); the re-fitted weights are
            returned in ``RefineResult.weight``.
        damp: re-fit damping, ``lambda = damp * mean(diag G)`` as ``refit_weights`` (``objective="refit"`` only;
            0 needs every ``G_SS`` positive definite).
        scope: ``"row"``: every row keeps its count (swaps within rows). ``"layer"``: only the layer's total count
            is kept; moves may also prune a weight in one row and restore one in another (each iteration applies
            the best combination of moves with every row in at most one; see ``core/layer_moves.py``). With
            ``objective="refit"`` the state of all rows is held at once (``layer_moves.LAYER_STATE_BYTES``).

    Returns:
        :class:`RefineResult` with the refined mask on ``weight``'s device.

    Raises:
        ValueError / TypeError: bad shapes, NaN, an empty Gram, a mask off its N:M pattern, an unknown
            ``objective`` / ``scope``, ``nm`` with ``scope="layer"``, ``damp < 0``, or (``objective="refit"``) a
            singular ``G_SS + lambda I`` (names the rows; raise ``damp``). Raised before any work is done, except
            the singular case, found while factorising.

    Example:
        >>> mask = warmstart_mask(w, "wanda", sparsity=0.6, gram=g)
        >>> res = refine_mask(w, g, mask, max_iters=100)
        >>> res.loss_after.sum() <= res.loss_before.sum()
        True
    """
    check_weight(weight)
    d_out, d_in = weight.shape
    check_gram(gram, d_in)
    check_mask(keep_mask, weight)
    if nm is not None:
        check_budget(None, nm, d_in)
        check_nm_mask(keep_mask, nm)
    if isinstance(max_iters, bool) or not isinstance(max_iters, int) or max_iters < 0:
        raise ValueError(f"max_iters must be an int >= 0, got {max_iters!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be 'mask' or 'refit', got {objective!r}")
    if scope not in SCOPES:
        raise ValueError(f"scope must be 'row' or 'layer', got {scope!r}")
    if scope == "layer" and nm is not None:
        raise ValueError(
            f"nm={tuple(nm)} fixes the count of every block of every row, so there is no layer budget to move; "
            "use scope='row' with nm, or scope='layer' without nm"
        )
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not damp >= 0:
        raise ValueError(f"damp must be a float >= 0 (e.g. 0.01), got {damp!r}")
    if isinstance(resync_every, bool) or not isinstance(resync_every, int) or resync_every < 1:
        raise ValueError(f"resync_every must be an int >= 1, got {resync_every!r}")
    compute = torch.device(device) if device is not None else weight.device
    search = resolve_backend(backend, compute, nm)
    if row_batch is not None and row_batch < 1:
        raise ValueError(f"row_batch must be >= 1, got {row_batch}")
    if scope == "layer" or objective == "refit":
        return _refine_other(
            weight, gram, keep_mask, max_iters=max_iters, nm=nm, eps=eps, row_batch=row_batch, compute=compute,
            dtype=dtype, search=search, resync_every=resync_every, objective=objective, damp=damp, scope=scope,
        )  # fmt: skip
    if row_batch is None:
        row_batch = max(1, ROW_BATCH_ELEMENTS // d_in)

    gram64 = gram.detach().to(device=compute, dtype=torch.float64)
    gram_search = gram64.to(dtype)
    mask = keep_mask.detach().clone()
    n_swaps = torch.zeros(d_out, dtype=torch.long)
    for r0 in range(0, d_out, row_batch):
        rows = slice(r0, min(d_out, r0 + row_batch))
        w64 = weight[rows].detach().to(device=compute, dtype=torch.float64)
        keep = mask[rows].to(compute)
        swaps = _refine_rows(w64, gram64, gram_search, keep, max_iters, eps, search, nm, resync_every)
        mask[rows] = keep.to(mask.device)
        n_swaps[rows] = swaps.cpu()
    return RefineResult(
        mask=mask,
        loss_before=_losses(weight, gram64, keep_mask),
        loss_after=_losses(weight, gram64, mask),
        n_swaps=n_swaps,
        iters=int(n_swaps.max()) if d_out else 0,
    )


def _refine_rows(
    w64: torch.Tensor,
    gram64: torch.Tensor,
    gram_search: torch.Tensor,
    keep: torch.Tensor,
    max_iters: int,
    eps: float,
    search: str,
    nm: tuple[int, int] | None,
    resync_every: int,
) -> torch.Tensor:
    """Run the swap loop on one row batch; ``keep`` ``[rows, d]`` is updated in place.

    Returns the per-row swap counts ``[rows]`` int64.
    """
    rows = w64.shape[0]
    w_search = w64.to(gram_search.dtype)
    corr64 = correlation(w64, gram64, keep)
    diag64 = torch.diagonal(gram64)
    active = torch.arange(rows, device=w64.device)
    n_swaps = torch.zeros(rows, dtype=torch.long, device=w64.device)
    it = 0
    while it < max_iters and active.numel() > 0:
        it += 1
        if it % resync_every == 0:
            corr64[active] = correlation(w64[active], gram64, keep[active])
        u, p, _ = best_swaps(
            search, w_search[active], keep[active], corr64[active].to(gram_search.dtype), gram_search, nm
        )
        u, p = u.to(w64.device), p.to(w64.device)
        w_act = w64[active]
        w_u = w_act.gather(1, u[:, None]).squeeze(1)
        w_p = w_act.gather(1, p[:, None]).squeeze(1)
        c_act = corr64[active]
        exact_dl = (
            2 * w_u * c_act.gather(1, u[:, None]).squeeze(1)
            + w_u * w_u * diag64[u]
            - 2 * w_p * c_act.gather(1, p[:, None]).squeeze(1)
            + w_p * w_p * diag64[p]
            - 2 * w_u * w_p * gram64[u, p]
        )
        feasible = keep[active, u] & ~keep[active, p] & (w_p != 0)
        accept = feasible & (exact_dl < -eps)
        rows_ok, u_ok, p_ok = active[accept], u[accept], p[accept]
        keep[rows_ok, u_ok] = False
        keep[rows_ok, p_ok] = True
        corr64[rows_ok] += w64[rows_ok, u_ok, None] * gram64[u_ok] - w64[rows_ok, p_ok, None] * gram64[p_ok]
        n_swaps[rows_ok] += 1
        active = rows_ok  # a row whose best swap does not improve has converged
    return n_swaps


def _refine_other(
    weight: torch.Tensor,
    gram: torch.Tensor,
    keep_mask: torch.Tensor,
    *,
    max_iters: int,
    nm: tuple[int, int] | None,
    eps: float,
    row_batch: int | None,
    compute: torch.device,
    dtype: torch.dtype,
    search: str,
    resync_every: int,
    objective: str,
    damp: float,
    scope: str,
) -> RefineResult:
    """``objective="refit"`` and/or ``scope="layer"`` (inputs already validated by :func:`refine_mask`)."""
    d_out, d_in = weight.shape
    gram64 = gram.detach().to(device=compute, dtype=torch.float64)
    w64 = weight.detach().to(device=compute, dtype=torch.float64)
    keep = keep_mask.detach().to(compute).clone()
    lam = rs.damping(gram64, damp)
    counts = keep.sum(dim=1)
    k_max = int(counts.max()) if d_out else 0
    q_max = int((d_in - counts).max()) if d_out else 0
    m = nm[1] if nm is not None else None
    if scope == "layer":
        if objective == "mask":
            rows = row_batch or max(1, ROW_BATCH_ELEMENTS // d_in)
            model = layer_moves.MaskRows(w64, gram64, keep, dtype=dtype, search=search, row_batch=rows)
            floor = eps
        else:
            rows = row_batch or max(1, rs.REFIT_ELEMENTS // max(1, (k_max + 1) * (q_max + 1)))
            model = layer_moves.RefitRows(w64, gram64, keep, lam=lam, row_batch=rows)
            floor = eps + rs.ACCEPT_RTOL * float(((w64 @ gram64) * w64).sum(dim=1).max())
        n_swaps, iters = layer_moves.refine_layer(model, max_iters=max_iters, eps=floor, resync_every=resync_every)
        keep, fitted = model.result()
        fitted_before = model.fitted_before if objective == "refit" else None
    else:
        rows = row_batch or max(1, rs.REFIT_ELEMENTS // max(1, k_max * q_max))
        fitted_before = torch.zeros_like(w64)
        fitted = torch.zeros_like(w64)
        n_swaps = torch.zeros(d_out, dtype=torch.long)
        for r0 in range(0, d_out, rows):
            sl = slice(r0, min(d_out, r0 + rows))
            swaps, fitted_before[sl], fitted[sl] = rs.refine_refit_rows(
                w64[sl], gram64, keep[sl], lam=lam, max_iters=max_iters, eps=eps, m=m,
                resync_every=resync_every, row_offset=r0,
            )  # fmt: skip
            n_swaps[sl] = swaps.cpu()
        iters = int(n_swaps.max()) if d_out else 0
    mask = keep.to(keep_mask.device)
    if objective == "mask":
        return RefineResult(
            mask=mask,
            loss_before=_losses(weight, gram64, keep_mask),
            loss_after=_losses(weight, gram64, mask),
            n_swaps=n_swaps.cpu(),
            iters=iters,
        )
    return RefineResult(
        mask=mask,
        loss_before=weight_losses(w64, fitted_before, gram64).cpu(),
        loss_after=weight_losses(w64, fitted, gram64).cpu(),
        n_swaps=n_swaps.cpu(),
        iters=iters,
        weight=fitted.to(device=weight.device, dtype=weight.dtype),
    )
