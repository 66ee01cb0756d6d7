"""ADMM pruning and weight update (Boza 2024, "Fast and Effective Weight Update for Pruned Large Language
Models", arXiv 2401.02938), as pure tensor functions.

A transcription of ``AdmmPruner.fasterprune`` from github.com/fmfi-compbio/admm-pruning (``lib/admm.py``,
commit 80392084a939dff5b15a160fb46499b478905506; called from ``lib/prune.py::prune_admm`` with
``percdamp=0.1`` and the defaults ``iterative_prune=15, iters=20, per_out=False``):

1. Normalise: ``n = sqrt(diag G) + 1e-8``, ``G' = G / (n n^T)``, ``W' = W * n`` (per input), so that the
   normalised Gram has a unit diagonal (``|W'|`` is Wanda's score).
2. Ridge: ``G' += damp * mean(diag G') I`` (``percdamp = 0.1``), then the target ``XY = G' W'`` (so the
   ridge pulls towards the dense weights), then ``G' += rho I`` and ``G'^-1`` (one ``torch.inverse``).
3. ADMM on ``min (W' - V)^T G' (W' - V)`` s.t. the mask: ``rho = 1``, ``U = 0``; ``iters = 20`` times:
   re-select the mask from ``|W + U|`` during the first ``reselect_iters = 15`` iterations, then
   ``Z = (W + U) * mask``, ``U += W - Z``, ``W = G'^-1 (XY + rho (Z - U))``.
4. Output ``(W + U) * mask / n`` in the weight's dtype.

Mask re-selection (the original's three branches):

* ``scope="layer"`` (published default, ``per_out=False``): the ``round(sparsity * numel)`` smallest
  ``|W + U|`` over the whole matrix are pruned at the *full* sparsity in every re-selecting iteration (no
  schedule: the original's layer-wise branch uses ``sparsity``, not ``cur_sparsity``).
* ``scope="row"`` (``per_out=True``): per output row, with the cubic schedule
  ``s_t = s - s (1 - (t + 1) / reselect_iters) ** 3`` (``floor(s_t * d_in)`` pruned per row).
* ``nm=(n, m)``: the N:M mask of ``|W + U|`` (``n`` largest of every ``m`` consecutive inputs of a row) with
  the same cubic schedule: at step ``t`` only the ``floor(s_t * numel)`` smallest entries outside the N:M
  mask are pruned (``s = (m - n) / m``), so the last re-selection is exactly the N:M mask.

Iterative pruning (ours; the original prunes dense layers only): with ``prior_mask`` (an earlier pruning's mask) the
weights it pruned stay pruned in every selection, and each row prunes ``sparsity`` of the weights the prior keeps
(``round(sparsity * kept)``, the score starts' rule, whatever ``scope``), through the same cubic schedule (``floor(s_t *
kept)`` pruned at step ``t``).

With ``reselect_iters=0`` (the original's ``iterative_prune=0``) the mask is chosen once from the normalised
weights ``|W * n|`` (Wanda's score) and kept fixed; :func:`admm_update` runs the same ADMM on a given mask.

The Gram: the original sums ``X^T X`` over calibration tokens like ours. Any positive scale of ``G`` cancels
in the normalisation (only the ``1e-8`` guard of ``n`` is not scaled), so averaging would not change results.

The original switches TF32 matmuls off globally; these functions change no global flag (TF32 matmuls are off
in torch's default settings; turning them on changes results on Ampere+ GPUs).

Float32 range: the normalised weights ``W * n`` and their products with ``G'`` and its inverse overflow float32
(NaN rows) for weights near its largest value (e.g. one weight of ``1e37``); where ``max|W| * max(n) * d_in^2``
exceeds :data:`FLOAT32_SAFE` (never for a trained model's weights) a ``dtype=float32`` call computes in float64
instead, as :mod:`~sparseswaps_prune.core.alps` does, and returns the weight's dtype as always.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from sparseswaps_prune.core.checks import (
    check_budget,
    check_gram,
    check_int,
    check_mask,
    check_number,
    check_positive,
    check_weight,
    kept_per_row,
)
from sparseswaps_prune.core.select import keep_top, select_mask_unchecked, select_within

# The original's defaults: percdamp=0.1 (passed by prune_admm), rho=1, iters=20, iterative_prune=15.
ADMM_DAMP = 0.1
ADMM_RHO = 1.0
ADMM_ITERS = 20
ADMM_RESELECT_ITERS = 15
# The original's guard on the normalisation, sqrt(diag G) + 1e-8.
NORM_EPS = 1e-8
# Above this bound on max|W * n| * d_in^2 (the growth of W' through G' and (G' + rho I)^-1) float32 could overflow.
FLOAT32_SAFE = 1e36


@dataclass
class ADMMResult:
    """Outcome of :func:`admm_prune`.

    Attributes:
        weight: ``[d_out, d_in]`` ADMM weights in the input weight's dtype and on its device; exactly zero
            where ``keep_mask`` is False.
        keep_mask: ``[d_out, d_in]`` bool, True = kept (the last re-selected mask), on the weight's device.
    """

    weight: torch.Tensor
    keep_mask: torch.Tensor


def admm_prune(
    weight: torch.Tensor,
    gram: torch.Tensor,
    *,
    sparsity: float | None = None,
    nm: tuple[int, int] | None = None,
    scope: Literal["layer", "row"] = "layer",
    iters: int = ADMM_ITERS,
    reselect_iters: int = ADMM_RESELECT_ITERS,
    rho: float = ADMM_RHO,
    damp: float = ADMM_DAMP,
    dtype: torch.dtype = torch.float32,
    prior_mask: torch.Tensor | None = None,
) -> ADMMResult:
    """Prune a linear layer with ADMM and gradual mask re-selection (Boza 2024).

    Deliberate differences from ``fasterprune``:

    * Counts: the final mask prunes exactly ``round(sparsity * numel)`` (layer) or ``round(sparsity * d_in)``
      per row (the project's rule, :func:`~sparseswaps_prune.core.checks.kept_per_row`) where the original
      prunes ``int(...)`` (floor); they agree whenever the product is an integer. Intermediate steps of the
      cubic schedule use the original's floor.
    * N:M: any ``(n, m)``; the original hard-codes groups of 4 keeping 2 (and ``sparsity = 0.5``) whatever
      ``--sparsity_type`` says, so it only equals ours for ``nm=(2, 4)``.
    * Ties: equal scores keep the lower index (stable sort); the original's ``topk``/``>=`` threshold leave
      them unspecified (the ``>=`` of ``per_out`` keeps all tied entries).
    * ``reselect_iters`` must not exceed ``iters`` (the original would stop its schedule short of the target).
    * A negative diagonal entry of ``gram`` (rounding) is clamped to 0 before the square root (the original
      would produce NaN).

    Args:
        weight: ``[d_out, d_in]`` float tensor (not modified).
        gram: ``[d_in, d_in]`` Gram matrix ``sum_t x_t x_t^T`` of the layer inputs (not modified; moved to
            ``weight``'s device).
        sparsity: fraction pruned, in ``[0, 1)``; exclusive with ``nm``.
        nm: ``(n, m)``: keep ``n`` of every ``m`` consecutive inputs of each row, e.g. ``(2, 4)``.
        scope: ``"layer"`` (published default) or ``"row"`` (the original's ``per_out``); ignored with ``nm``.
        iters: ADMM iterations (20); 0 returns the initial Wanda mask with the original weights.
        reselect_iters: the first iterations that re-select the mask (15, ``iterative_prune``); 0 fixes the
            Wanda mask of the normalised weights.
        rho: ADMM penalty (1).
        damp: relative ridge, ``damp * mean(diag G')`` on the normalised Gram (``percdamp``, 0.1).
        dtype: computation dtype, ``torch.float32`` (the original) or ``torch.float64``.
        prior_mask: ``[d_out, d_in]`` bool mask of an earlier pruning (True = kept; not modified): the mask stays
            within it and each row prunes ``sparsity`` of what it keeps (see the module docstring); not with ``nm``.
            ``weight`` is taken as given (``prune_layer`` passes it zeroed where the prior prunes).

    Returns:
        :class:`ADMMResult` with the weight (``weight``'s dtype and device) and the bool mask.

    Raises:
        ValueError: bad shapes, NaN, an empty Gram, a bad budget, scope, iteration count, ``rho`` or ``damp``, a
            prior mask with ``nm``.
        TypeError: non-tensor or non-float inputs, a bad ``dtype``.

    Example:
        >>> res = admm_prune(layer.weight, acc.gram, sparsity=0.6)
        >>> layer.weight.data.copy_(res.weight)
    """
    check_weight(weight)
    d_out, d_in = weight.shape
    check_gram(gram, d_in)
    check_budget(sparsity, nm, d_in)
    if scope not in ("layer", "row"):
        raise ValueError(f"scope must be 'layer' (published ADMM) or 'row' (the original's per_out), got {scope!r}")
    check_int(iters, "iters", low=0)
    check_int(reselect_iters, "reselect_iters", low=0)
    if reselect_iters > iters:
        raise ValueError(
            f"reselect_iters={reselect_iters} exceeds iters={iters}: the mask schedule would stop short of the "
            f"target sparsity; use reselect_iters <= iters (the original uses 15 of 20)"
        )
    if prior_mask is not None:
        check_mask(prior_mask, weight, what="prior_mask")
        if nm is not None:
            raise ValueError(
                "N:M pruning of an already pruned tensor (prior_mask) is not supported: its groups would not hold n "
                "of m; start from the dense weights"
            )
        prior_mask = prior_mask.to(weight.device)
    norm, xx_inv, xy, w = _setup(weight, gram, rho, damp, dtype)
    select = _selector(d_out, d_in, sparsity, nm, scope, reselect_iters, prior_mask)
    mask_t = select(w.abs(), None) if reselect_iters == 0 else None
    out_t, mask_t = _admm(w, xy, xx_inv, rho, iters, mask_t, select if reselect_iters else None, reselect_iters)
    return ADMMResult(weight=(out_t.T / norm).to(weight.dtype), keep_mask=mask_t.T.contiguous())


def admm_update(
    weight: torch.Tensor,
    gram: torch.Tensor,
    keep_mask: torch.Tensor,
    *,
    iters: int = ADMM_ITERS,
    rho: float = ADMM_RHO,
    damp: float = ADMM_DAMP,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """ADMM weight update of a given mask (Boza 2024, Algorithm 1): the ADMM of :func:`admm_prune` with the
    mask fixed throughout (the original's ``iterative_prune=0`` path, with ``keep_mask`` in place of its
    Wanda mask).

    Args:
        weight: ``[d_out, d_in]`` float tensor (not modified).
        gram: ``[d_in, d_in]`` Gram matrix of the layer inputs (not modified).
        keep_mask: ``[d_out, d_in]`` bool, True = kept (not modified).
        iters: ADMM iterations (20); 0 returns ``weight * keep_mask``.
        rho: ADMM penalty (1).
        damp: relative ridge on the normalised Gram (0.1).
        dtype: computation dtype, ``torch.float32`` or ``torch.float64``.

    Returns:
        ``[d_out, d_in]`` tensor of ``weight``'s dtype and device, exactly zero where ``keep_mask`` is False.

    Raises:
        ValueError: bad shapes, NaN, an empty Gram, a bad ``iters``, ``rho`` or ``damp``.
        TypeError: non-tensor or non-float inputs, a non-bool mask, a bad ``dtype``.

    Example:
        >>> new_weight = admm_update(layer.weight, acc.gram, mask)
    """
    check_weight(weight)
    check_gram(gram, weight.shape[1])
    check_mask(keep_mask, weight)
    check_int(iters, "iters", low=0)
    norm, xx_inv, xy, w = _setup(weight, gram, rho, damp, dtype)
    out_t, _ = _admm(w, xy, xx_inv, rho, iters, keep_mask.to(w.device).T, None, 0)
    return (out_t.T / norm).to(weight.dtype)


def _setup(
    weight: torch.Tensor, gram: torch.Tensor, rho: float, damp: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate ``rho``/``damp``/``dtype``; return ``(n [d_in], G'^-1, XY [d_in, d_out], W' [d_in, d_out])``
    in ``dtype`` (float64 where float32 could overflow, see the module docstring), in the original's transposed
    layout."""
    check_positive(rho, "rho", note="the ADMM penalty, 1 in the original")
    check_number(damp, "damp", low=0.0)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    xx = gram.detach().to(device=weight.device, dtype=dtype).clone()
    norm = torch.diagonal(xx).clamp_min(0).sqrt() + NORM_EPS
    bound = float(weight.detach().abs().max()) * float(norm.max()) * xx.shape[0] ** 2
    if dtype == torch.float32 and bound > FLOAT32_SAFE:
        return _setup(weight, gram, rho, damp, torch.float64)
    xx = xx / norm
    xx = (xx.T / norm).T
    w = (weight.detach().to(dtype) * norm).T
    diag = torch.arange(xx.shape[0], device=xx.device)
    xx[diag, diag] += damp * torch.diag(xx).mean()  # torch.diag: a contiguous copy, summed as the original sums it
    xy = xx.matmul(w)
    xx[diag, diag] += rho
    return norm, torch.inverse(xx), xy, w


Selector = Callable[[torch.Tensor, "int | None"], torch.Tensor]


def _selector(
    d_out: int,
    d_in: int,
    sparsity: float | None,
    nm: tuple[int, int] | None,
    scope: str,
    reselect_iters: int,
    prior: torch.Tensor | None,
) -> Selector:
    """``select(scores_t [d_in, d_out], step) -> mask_t`` (bool, True = kept, transposed layout). ``step`` is
    the re-selection iteration (``None``: the full budget at once); ``prior`` ``[d_out, d_in]``: select within it."""
    numel = d_out * d_in

    def fraction(step: int | None, target: float) -> float | None:  # the cubic schedule; None = final
        if step is None or step + 1 >= reselect_iters:
            return None
        return target - target * (1 - (step + 1) / reselect_iters) ** 3

    def select(scores_t: torch.Tensor, step: int | None) -> torch.Tensor:
        scores = scores_t.T
        if prior is not None:
            return select_within(scores, prior, sparsity, fraction=fraction(step, sparsity)).T
        if nm is not None:
            n, m = nm
            keep_nm = keep_top(scores.reshape(d_out, d_in // m, m), n).reshape(d_out, d_in)
            cur = fraction(step, (m - n) / m)
            if cur is None:
                return keep_nm.T
            pruned = min(int(numel * cur), numel - numel // m * n)
            outside = scores.masked_fill(keep_nm, torch.inf)
            return keep_top(outside.reshape(1, -1), numel - pruned).reshape(d_out, d_in).T
        if scope == "layer":  # the original re-selects at the full sparsity (no schedule)
            return select_mask_unchecked(scores, sparsity=sparsity, scope="layer").T
        cur = fraction(step, sparsity)
        if cur is None:
            return select_mask_unchecked(scores, sparsity=sparsity, scope="row").T
        return keep_top(scores, d_in - min(int(d_in * cur), d_in - kept_per_row(sparsity, d_in))).T

    return select


def _admm(
    w: torch.Tensor,
    xy: torch.Tensor,
    xx_inv: torch.Tensor,
    rho: float,
    iters: int,
    mask: torch.Tensor | None,
    select: Selector | None,
    reselect_iters: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The original's loop in its ``[d_in, d_out]`` layout; returns ``((W + U) * mask, mask)``."""
    u = torch.zeros_like(w)
    for itt in range(iters):
        if select is not None and itt < reselect_iters:
            mask = select((w + u).abs(), itt)
        z = torch.where(mask, w + u, 0.0)
        u = u + (w - z)
        w = xx_inv.matmul(xy + rho * (z - u))
    return torch.where(mask, w + u, 0.0), mask
