"""SparseSwaps refinement (Algorithm 1 of arXiv 2512.10922), for all rows at once.

Every iteration applies each row's single best 1-swap (prune a kept ``u``, restore a pruned ``p``) when
it lowers that row's loss ``L = r^T G r``, ``r = (1 - m) * w``, by more than ``eps``. The search runs in
the compute dtype (float32 by default) on a backend; the chosen swap's ``dL`` is then re-evaluated in
float64 and the correlation vector ``c = G r`` is kept in float64 (updated by
``c += w_u G[:, u] - w_p G[:, p]`` and rebuilt from scratch every ``resync_every`` iterations), so an
accepted swap never raises the float64 loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparseswaps_prune.core.backends import best_swaps, resolve_backend
from sparseswaps_prune.core.checks import check_budget, check_gram, check_mask, check_weight
from sparseswaps_prune.core.losses import correlation, row_losses

# Rows per batch when the caller gives none: bounds the [rows, d_in] working set to ~64 MiB per tensor.
ROW_BATCH_ELEMENTS = 1 << 24


@dataclass
class RefineResult:
    """Outcome of :func:`refine_mask`.

    Attributes:
        mask: ``[d_out, d_in]`` bool refined mask (True = kept), on the weight's device.
        loss_before: ``[d_out]`` float64 per-row loss of the input mask.
        loss_after: ``[d_out]`` float64 per-row loss of ``mask`` (same definition as ``row_losses``).
        n_swaps: ``[d_out]`` int64 number of swaps applied to each row.
        iters: number of iterations that applied at least one swap (``n_swaps.max()``, at most
            ``max_iters``).
    """

    mask: torch.Tensor
    loss_before: torch.Tensor
    loss_after: torch.Tensor
    n_swaps: torch.Tensor
    iters: int

    @property
    def relative_reduction(self) -> float:
        """``1 - sum(loss_after) / sum(loss_before)`` (0 when the input mask had no loss)."""
        before = float(self.loss_before.sum())
        return 0.0 if before <= 0 else 1.0 - float(self.loss_after.sum()) / before


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
) -> RefineResult:
    """Refine a pruning mask by exact, loss-decreasing 1-swaps.

    Args:
        weight: ``[d_out, d_in]`` float tensor (not modified).
        gram: ``[d_in, d_in]`` Gram matrix ``sum_t x_t x_t^T`` of the layer inputs (not modified).
        keep_mask: ``[d_out, d_in]`` bool warmstart mask, True = kept, from any source (each row keeps
            its own count; not modified).
        max_iters: at most this many swaps per row (``T_max``); 0 returns the input mask.
        nm: ``(n, m)``: swaps stay inside blocks of ``m`` consecutive inputs; ``keep_mask`` must follow
            the pattern.
        eps: a row stops once its best ``dL`` is not below ``-eps``.
        row_batch: rows refined together (bounds memory); default fits ~64 MiB per ``[rows, d_in]``.
        device: where to compute (default: the weight's device).
        dtype: search dtype, ``torch.float32`` (fast) or ``torch.float64``.
        backend: ``"auto"`` (compiled numba kernel on CPU, fused Triton kernel on CUDA when triton is
            installed, torch elsewhere), ``"torch"``, ``"numba"`` or ``"triton"``.
        resync_every: rebuild the float64 correlation vectors from scratch every this many iterations.

    Returns:
        :class:`RefineResult` with the refined mask on ``weight``'s device.

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
    compute = torch.device(device) if device is not None else weight.device
    search = resolve_backend(backend, compute, nm)
    if row_batch is None:
        row_batch = max(1, ROW_BATCH_ELEMENTS // d_in)
    if row_batch < 1:
        raise ValueError(f"row_batch must be >= 1, got {row_batch}")

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
        loss_before=row_losses(weight, gram, keep_mask).cpu(),
        loss_after=row_losses(weight, gram, mask).cpu(),
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
