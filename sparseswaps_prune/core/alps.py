"""ALPS (Meng et al., NeurIPS 2024, "ALPS: Improved Optimization for Highly Sparse One-Shot Pruning for Large
Language Models", arXiv 2406.07831), as pure tensor functions.

A transcription of ``ALPS_prune.ALPS_admm`` and ``ALPS_prune.cg_batch`` from github.com/mazumder-lab/ALPS
(``alps.py``, commit 8af9e6b5c8b1b06a028bde6065e5c38829df3a19; called from ``opt.py``/``llama.py`` with
``rho=0.1`` and the defaults ``max_iter=300, update_iter=3, switch_iter=30``):

1. Ridge, then normalise: ``G += damp * mean(diag G) I`` (``damp = 0.01``), ``n = sqrt(diag G) + 1e-8``,
   ``G' = G / (n n^T)`` (unit diagonal), ``B0 = (W * n)^T`` (``[d_in, d_out]``), target ``G' B0``.
2. ADMM on ``min (B - B0)^T G' (B - B0)`` s.t. ``B`` sparse, with ``(G' + rho I)^-1`` from one float64
   eigendecomposition of ``G'``: ``B = (G' + rho I)^-1 (G' B0 - V + rho D)``, ``D = P(B + V / rho)``,
   ``V += rho (B - D)``, where ``P`` keeps the largest ``|.|`` under the budget (layer-wise top-k, or N:M). It
   starts from ``D = P(B0)``, ``V = 0``, ``rho = 0.1``.
3. Every ``update_iter = 3`` iterations, with ``c`` the number of entries whose support changed since the
   last check and ``k`` the number kept: ``c / k > 0.1``: ``rho *= 1.3``; ``c / k > 0.005``: ``rho *= 1.2``;
   else ``c > 0`` (``> 0.5``): ``rho *= 1.1`` once ``rho`` was ever raised, otherwise ``rho /= 5`` and restart
   from ``B0, P(B0), V = 0``; else (no change): stop once ``rho`` was ever raised, otherwise ``rho /= 5``.
   ``rho`` is capped at ``1e6``; past ``switch_iter = 30`` iterations the loop also stops when
   ``c / k < 3e-4``; at most ``max_iter = 300`` iterations.
4. ``B = P(B)``, then ``cg_iters = 10`` conjugate-gradient steps on ``G' B = G' B0`` restricted to the support
   of ``B``, all ``d_out`` columns at once (no preconditioner is passed: ``M_bmm=None``; the unit-diagonal
   normalisation is the Jacobi preconditioning), stopping early only if every row of the full residual
   ``G' B - G' B0`` is within ``rtol = 1e-4`` of the target's row norm.
5. Output ``B^T / n`` in the weight's dtype.

The Gram: the original sums ``X^T X`` over calibration tokens like ours; the ridge is relative and the
normalisation removes any positive scale (only the ``1e-8`` guard is not scaled), so averaging would not
change results.

The original switches TF32 matmuls off globally; these functions change no global flag (TF32 matmuls are off
in torch's default settings; turning them on changes results on Ampere+ GPUs).

Float32 range: CG's inner products sum, over ``d_in`` inputs, squares of residuals up to ``d_in * max|W * n|``, so
float32 can overflow (``inf / inf``: NaN rows) once ``max|W * n| * d_in^1.5`` nears ``sqrt(3.4e38) = 1.8e19``; a
single weight of ``1e25`` does it. Where ``max|W| * max(n) * d_in^1.5`` exceeds :data:`FLOAT32_SAFE` (never for the
weights and activations of a trained model: that takes ``|W * n|`` above ``5e10`` at ``d_in = 14336``), a
``dtype=float32`` call computes in float64 instead, the same algorithm in a range that holds those squares; the
result is returned in the weight's dtype as always.
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
from sparseswaps_prune.core.select import select_mask_unchecked

# The original's defaults (rho=0.1 is what opt.py/llama.py pass).
ALPS_DAMP = 0.01
ALPS_RHO = 0.1
ALPS_MAX_ITER = 300
ALPS_UPDATE_ITER = 3
ALPS_SWITCH_ITER = 30
ALPS_CG_ITERS = 10
ALPS_CG_RTOL = 1e-4
# ADMM iterations the original's (never enabled) fix_supp branch runs under the default stopping rule: the
# support never changes, so it stops at the first check past switch_iter, iteration 33.
ALPS_UPDATE_ADMM_ITERS = 33
RHO_MAX = 1e6
NORM_EPS = 1e-8
# Above this bound on max|W * n| * d_in^1.5 a float32 computation could overflow CG's squared sums (float32's
# largest value is 3.4e38; the bound's square is 1e34, which leaves CG's intermediate growth a 3e4 margin).
FLOAT32_SAFE = 1e17


@dataclass
class ALPSResult:
    """Outcome of :func:`alps_prune`.

    Attributes:
        weight: ``[d_out, d_in]`` ALPS weights in the input weight's dtype and on its device; exactly zero
            where ``keep_mask`` is False.
        keep_mask: ``[d_out, d_in]`` bool, True = kept, on the weight's device.
        admm_iters: ADMM iterations run (at most ``max_iter``).
        rho: the final ADMM penalty.
    """

    weight: torch.Tensor
    keep_mask: torch.Tensor
    admm_iters: int
    rho: float


def alps_prune(
    weight: torch.Tensor,
    gram: torch.Tensor,
    *,
    sparsity: float | None = None,
    nm: tuple[int, int] | None = None,
    scope: Literal["layer", "row"] = "layer",
    rho: float = ALPS_RHO,
    max_iter: int = ALPS_MAX_ITER,
    update_iter: int = ALPS_UPDATE_ITER,
    switch_iter: int = ALPS_SWITCH_ITER,
    cg_iters: int = ALPS_CG_ITERS,
    cg_rtol: float = ALPS_CG_RTOL,
    damp: float = ALPS_DAMP,
    dtype: torch.dtype = torch.float32,
) -> ALPSResult:
    """Prune a linear layer with ALPS (ADMM with an adaptive penalty, then CG on the support).

    Deliberate differences from ``ALPS_admm``:

    * Counts: the layer keeps ``numel - round(sparsity * numel)`` (the project's rule) where the original
      keeps ``np.round((1 - sparsity) * numel)``; they differ only when ``sparsity * numel`` is not an
      integer (by at most one weight).
    * ``scope="row"`` (every row keeps ``d_in - round(sparsity * d_in)``) is our extension; the original
      only has the layer-wise projection and N:M.
    * Supports are tracked as the selected masks; the original tests ``== 0``, so a selected entry that is
      exactly 0.0 counts as pruned there (and is left out of its CG). Equal magnitudes keep the lower index
      (stable sort; the original's ``topk`` leaves ties unspecified).
    * The diagnostics that never change the result (the relative errors of ``Btest``, prints, timings) are
      not computed. A budget that keeps nothing returns zeros without running (the original divides by 0).

    Args:
        weight: ``[d_out, d_in]`` float tensor (not modified).
        gram: ``[d_in, d_in]`` Gram matrix ``sum_t x_t x_t^T`` of the layer inputs (not modified; moved to
            ``weight``'s device).
        sparsity: fraction pruned, in ``[0, 1)``; exclusive with ``nm``.
        nm: ``(n, m)``: keep ``n`` of every ``m`` consecutive inputs of each row, e.g. ``(2, 4)``.
        scope: ``"layer"`` (the original) or ``"row"``; ignored with ``nm``.
        rho: initial ADMM penalty (0.1).
        max_iter: ADMM iteration cap (300).
        update_iter: iterations between support checks and penalty updates (3).
        switch_iter: iterations after which a support change below ``3e-4`` of the kept count stops (30).
        cg_iters: conjugate-gradient steps on the final support (10); 0 skips them.
        cg_rtol: CG's relative residual tolerance (``1e-4``).
        damp: relative ridge ``damp * mean(diag G)`` added before the normalisation (0.01).
        dtype: computation dtype, ``torch.float32`` (the original) or ``torch.float64``; the
            eigendecomposition is always float64, as in the original. Float32 becomes float64 where weights this
            large would overflow it (see the module docstring).

    Returns:
        :class:`ALPSResult` with the weight (``weight``'s dtype and device), the bool mask, the ADMM
        iterations run and the final ``rho``.

    Raises:
        ValueError: bad shapes, NaN, an empty Gram, a bad budget, scope, iteration count, ``rho``, ``damp``
            or ``cg_rtol``.
        TypeError: non-tensor or non-float inputs, a bad ``dtype``.

    Example:
        >>> res = alps_prune(layer.weight, acc.gram, sparsity=0.7)
        >>> layer.weight.data.copy_(res.weight)
    """
    check_weight(weight)
    d_out, d_in = weight.shape
    check_gram(gram, d_in)
    check_budget(sparsity, nm, d_in)
    if scope not in ("layer", "row"):
        raise ValueError(f"scope must be 'layer' (the original ALPS) or 'row', got {scope!r}")
    check_int(max_iter, "max_iter", low=0)
    check_int(update_iter, "update_iter", low=1)
    check_int(switch_iter, "switch_iter", low=0)
    _check_common(rho, cg_iters, cg_rtol, damp, dtype)

    def project(values: torch.Tensor) -> torch.Tensor:  # [d_in, d_out] -> keep mask, same layout
        return select_mask_unchecked(values.abs().T, sparsity=sparsity, nm=nm, scope=scope).T

    if nm is not None:
        kept = d_out * (d_in // nm[1]) * nm[0]
    elif scope == "row":
        kept = d_out * kept_per_row(sparsity, d_in)
    else:
        kept = kept_per_row(sparsity, d_out * d_in)
    if kept == 0:
        keep_mask = torch.zeros(d_out, d_in, dtype=torch.bool, device=weight.device)
        return ALPSResult(weight=torch.zeros_like(weight), keep_mask=keep_mask, admm_iters=0, rho=float(rho))

    x_norm, xtx, target, b_orig = _setup(weight, gram, damp, dtype)
    b, rho, iters = _admm(xtx, target, b_orig, project, kept, float(rho), max_iter, update_iter, switch_iter)
    keep = project(b)
    b = torch.where(keep, b, 0.0)
    b = _cg(xtx, target, keep, b, cg_rtol, cg_iters)
    out = (b.t() / x_norm).to(weight.dtype)
    return ALPSResult(weight=out, keep_mask=keep.T.contiguous(), admm_iters=iters, rho=rho)


def alps_update(
    weight: torch.Tensor,
    gram: torch.Tensor,
    keep_mask: torch.Tensor,
    *,
    admm_iters: int = ALPS_UPDATE_ADMM_ITERS,
    rho: float = ALPS_RHO,
    cg_iters: int = ALPS_CG_ITERS,
    cg_rtol: float = ALPS_CG_RTOL,
    damp: float = ALPS_DAMP,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """ALPS's weights for a given mask: ADMM with the support fixed, then the CG back-solve on it.

    The ADMM is the original's ``fix_supp`` branch (present in ``ALPS_admm`` but never switched on):
    ``D = (B + V / rho) * mask`` with ``rho`` held constant (the penalty schedule is skipped under
    ``fix_supp``). Under the default stopping rule the support never changes, so it runs 33 iterations
    (``admm_iters``). Deliberately, ``D`` starts from the masked normalised weights (the original's branch
    would start from the top-k mask) and the final ``B`` is restricted to ``keep_mask`` (the original would
    re-project it to a top-k support that may differ from the fixed one). ``admm_iters=0`` is the bare
    back-solve: ``cg_iters`` CG steps from the masked weights.

    Args:
        weight: ``[d_out, d_in]`` float tensor (not modified).
        gram: ``[d_in, d_in]`` Gram matrix of the layer inputs (not modified).
        keep_mask: ``[d_out, d_in]`` bool, True = kept (not modified).
        admm_iters: fixed-support ADMM iterations (33).
        rho: ADMM penalty (0.1).
        cg_iters: CG steps on the support (10).
        cg_rtol: CG's relative residual tolerance (``1e-4``).
        damp: relative ridge added before the normalisation (0.01).
        dtype: computation dtype, ``torch.float32`` or ``torch.float64`` (float64 where float32 would overflow,
            as in :func:`alps_prune`).

    Returns:
        ``[d_out, d_in]`` tensor of ``weight``'s dtype and device, exactly zero where ``keep_mask`` is False.

    Raises:
        ValueError: bad shapes, NaN, an empty Gram, a bad iteration count, ``rho``, ``damp`` or ``cg_rtol``.
        TypeError: non-tensor or non-float inputs, a non-bool mask, a bad ``dtype``.

    Example:
        >>> new_weight = alps_update(layer.weight, acc.gram, mask)
    """
    check_weight(weight)
    check_gram(gram, weight.shape[1])
    check_mask(keep_mask, weight)
    check_int(admm_iters, "admm_iters", low=0)
    _check_common(rho, cg_iters, cg_rtol, damp, dtype)
    x_norm, xtx, target, b_orig = _setup(weight, gram, damp, dtype)
    keep = keep_mask.to(b_orig.device).T
    b = torch.where(keep, b_orig, 0.0)
    if admm_iters:
        eigenvalues, eigenvectors = torch.linalg.eigh(xtx.double())
        xtx_inv = _shifted_inverse(eigenvalues, eigenvectors, rho, xtx.dtype)  # float64 where float32 overflows
        d = b
        v = torch.zeros_like(b)
        for _ in range(admm_iters):
            b = xtx_inv @ (target - v + rho * d)
            d = torch.where(keep, (v + rho * b) / rho, 0.0)
            v = v + rho * (b - d)
        b = torch.where(keep, b, 0.0)
    b = _cg(xtx, target, keep, b, cg_rtol, cg_iters)
    return (b.t() / x_norm).to(weight.dtype)


def _check_common(rho: float, cg_iters: int, cg_rtol: float, damp: float, dtype: torch.dtype) -> None:
    check_positive(rho, "rho", note="the initial ADMM penalty, 0.1 in ALPS")
    check_int(cg_iters, "cg_iters", low=0)
    check_positive(cg_rtol, "cg_rtol", note="CG's relative tolerance, 1e-4 in ALPS")
    check_number(damp, "damp", low=0.0)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")


def _setup(
    weight: torch.Tensor, gram: torch.Tensor, damp: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(n [d_in], G' [d_in, d_in], G' B0 [d_in, d_out], B0 [d_in, d_out])`` in ``dtype``, or in float64
    where ``dtype`` is float32 and the normalised weights could overflow it (:func:`_float32_overflows`)."""
    xtx = gram.detach().to(device=weight.device, dtype=dtype).clone()
    diag = torch.arange(xtx.shape[0], device=xtx.device)
    xtx[diag, diag] += damp * torch.mean(torch.diag(xtx)).item()  # a contiguous copy, summed as the original sums it
    x_norm = torch.diagonal(xtx).clamp_min(0).sqrt() + NORM_EPS
    if dtype == torch.float32 and _float32_overflows(weight, x_norm):
        return _setup(weight, gram, damp, torch.float64)
    xtx = xtx / x_norm
    xtx = (xtx.T / x_norm).T
    w = weight.detach().to(dtype)
    target = torch.matmul(w * x_norm, xtx).T
    return x_norm, xtx, target, (w * x_norm).t().clone()


def _float32_overflows(weight: torch.Tensor, x_norm: torch.Tensor) -> bool:
    """Whether ``max|W| * max(n) * d_in^1.5`` (a bound on the normalised weights' CG sums' square roots)
    exceeds :data:`FLOAT32_SAFE`; computed in Python floats (float64), which hold it for any float32 input."""
    bound = float(weight.detach().abs().max()) * float(x_norm.max()) * weight.shape[1] ** 1.5
    return bound > FLOAT32_SAFE


def _shifted_inverse(eigenvalues: torch.Tensor, eigenvectors: torch.Tensor, rho: float, dtype: torch.dtype):
    """``(G' + rho I)^-1`` from the float64 eigendecomposition, cast to ``dtype`` (the original's ``XTX_inv``)."""
    return (eigenvectors @ ((1 / (eigenvalues + rho)) * eigenvectors).T).to(dtype)


def _admm(
    xtx: torch.Tensor,
    target: torch.Tensor,
    b_orig: torch.Tensor,
    project: Callable[[torch.Tensor], torch.Tensor],
    kept: int,
    rho: float,
    max_iter: int,
    update_iter: int,
    switch_iter: int,
) -> tuple[torch.Tensor, float, int]:
    """The original's ADMM loop with its penalty schedule; returns ``(B, final rho, iterations run)``."""
    eigenvalues, eigenvectors = torch.linalg.eigh(xtx.double())
    xtx_inv = _shifted_inverse(eigenvalues, eigenvectors, rho, xtx.dtype)
    keep_prev = project(b_orig)  # the original's D_suppp (as a kept mask)
    d_init = torch.where(keep_prev, b_orig, 0.0)
    b, d, v = b_orig, d_init, torch.zeros_like(b_orig)
    raised = False  # the original's init_rho
    iters = 0
    for i_admm in range(max_iter):
        iters = i_admm + 1
        b = xtx_inv @ (target - v + rho * d)
        d = (v + rho * b) / rho
        keep = project(d)
        d = torch.where(keep, d, 0.0)
        v = v + rho * (b - d)
        if (i_admm + 1) % update_iter != 0:
            continue
        change = int((keep != keep_prev).sum())
        if change / kept > 0.1:
            raised = True
            rho *= 1.3
        elif change / kept > 0.005:
            raised = True
            rho *= 1.2
        elif change > 0.5:
            if raised:
                rho *= 1.1
            else:
                rho /= 5
                b, d, v = b_orig.clone(), d_init.clone(), torch.zeros_like(b_orig)
        elif raised:
            break
        else:
            rho /= 5
        keep_prev = keep
        rho = min(rho, RHO_MAX)
        xtx_inv = _shifted_inverse(eigenvalues, eigenvectors, rho, xtx.dtype)
        if i_admm >= switch_iter and change / kept < 0.0003:
            break
    return b, rho, iters


def _cg(
    a: torch.Tensor, rhs: torch.Tensor, keep: torch.Tensor, x0: torch.Tensor, rtol: float, max_steps: int
) -> torch.Tensor:
    """The original's ``cg_batch`` with ``M_bmm=None`` and ``atol=0``: CG on ``a x = rhs`` for every column of
    ``x`` (``[d_in, d_out]``), residuals restricted to ``keep``, from ``x0`` (zero off ``keep``)."""
    x = x0
    r = torch.where(keep, rhs - a @ x, 0.0)
    stop = rtol * torch.norm(rhs, dim=1)
    p = r1 = z1 = r
    for k in range(1, max_steps + 1):
        z = r  # no preconditioner
        if k == 1:
            p, r1, z1 = z, r, z
        else:
            r2, z2, p1 = r1, z1, p
            r1, z1 = r, z
            denominator = (r2 * z2).sum(0)
            denominator[denominator == 0] = 1e-8
            beta = (r1 * z1).sum(0) / denominator
            p = z1 + beta.unsqueeze(0) * p1
        ap = a @ p
        denominator = (p * ap).sum(0)
        denominator[denominator == 0] = 1e-8
        alpha = (r1 * z1).sum(0) / denominator
        x = x + alpha.unsqueeze(0) * p
        r = torch.where(keep, r1 - alpha.unsqueeze(0) * ap, 0.0)
        if bool((torch.norm(a @ x - rhs, dim=1) <= stop).all()):
            break
    return x
