"""SparseGPT (Frantar & Alistarh 2023): one-shot pruning with OBS weight updates, as a pure tensor function.

A transcription of ``SparseGPT.fasterprune`` from github.com/IST-DASLab/sparsegpt (``sparsegpt.py``):
inputs that never fire (``H_ii = 0``) get ``H_ii = 1`` and a zeroed weight column; ``H`` is dampened by
``damp * mean(diag H)``; the upper Cholesky factor of ``H^-1`` drives column-by-column OBS updates in
blocks of ``blocksize`` columns, with lazy batched updates of the columns to the right of each block. The
mask of each block is chosen when the block starts, by the OBS score ``w^2 / [H^-1]_jj^2`` of the
already-updated weights (N:M: every ``m`` columns, on the weights updated up to that column).

Only the unstructured count per block differs from the original (see :func:`sparsegpt_prune`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal

import torch

from sparseswaps_prune.core.checks import check_budget, check_gram, check_mask, check_weight
from sparseswaps_prune.core.select import keep_top

# SparseGPT's dampening: damp * mean(diag H) is added to the Hessian's diagonal (the original's percdamp).
SPARSEGPT_DAMP = 0.01


@dataclass
class SparseGPTResult:
    """Outcome of :func:`sparsegpt_prune`.

    Attributes:
        weight: ``[d_out, d_in]`` pruned (and, with ``update_weights=True``, OBS-updated) weight, in the input
            weight's dtype and on its device; exactly zero where ``keep_mask`` is False (and also in the
            columns of dead inputs, which SparseGPT zeroes).
        keep_mask: ``[d_out, d_in]`` bool, True = kept, on the weight's device.
    """

    weight: torch.Tensor
    keep_mask: torch.Tensor


def sparsegpt_prune(
    weight: torch.Tensor,
    gram: torch.Tensor,
    *,
    sparsity: float | None = None,
    nm: tuple[int, int] | None = None,
    scope: Literal["layer", "row"] = "layer",
    blocksize: int = 128,
    damp: float = SPARSEGPT_DAMP,
    update_weights: bool = True,
    dtype: torch.dtype = torch.float32,
    keep_mask: torch.Tensor | None = None,
) -> SparseGPTResult:
    """Prune a linear layer with SparseGPT.

    ``gram`` is our summed Gram ``G = sum_t x_t x_t^T``; SparseGPT's Hessian is ``H = (2 / n) G``. A
    positive scale ``c`` multiplies every OBS score of the layer by the same ``c`` and cancels in every
    update (``U^-1`` of the Cholesky factor scales by ``sqrt(c)``, the row of ``U`` by ``1 / sqrt(c)``), and
    the dampening ``damp * mean(diag H)`` scales with it, so masks and weights equal the original's up to
    float rounding, except that the placeholder ``H_ii = 1`` of a dead input is not scaled and so shifts
    ``mean(diag H)``, hence the dampening, slightly differently on the two scales.

    Selection (the only intended difference from ``fasterprune`` is the unstructured count per block):

    * ``scope="layer"`` (published): one threshold over all rows of each block of columns, so rows keep
      unequal counts. The original prunes every score ``<=`` the ``int(sparsity * numel_block)``-th smallest,
      i.e. one weight more than ``floor`` per block; here block ``b`` prunes exactly
      ``round(sparsity * d_out * end_b) - round(sparsity * d_out * start_b)`` weights (cumulative rounding),
      so the layer prunes exactly ``round(sparsity * numel)``.
    * ``scope="row"``: the same per-block counts from cumulative rounding, per row, so every row keeps
      exactly ``d_in - round(sparsity * d_in)`` weights (a warmstart for SparseSwaps, which keeps per-row
      counts).
    * ``nm=(n, m)``: keeps ``n`` of every ``m`` consecutive inputs (the original's ``prunen = m - n``
      pruned), chosen every ``m`` columns; ``blocksize`` must be a multiple of ``m``.

    Equal scores keep the lower index (stable sort; the original's ``<=`` threshold and ``topk`` leave ties
    unspecified).

    Args:
        weight: ``[d_out, d_in]`` float tensor (not modified).
        gram: ``[d_in, d_in]`` Gram matrix of the layer inputs (not modified; moved to ``weight``'s device).
        sparsity: fraction pruned, in ``[0, 1)``; exclusive with ``nm``.
        nm: ``(n, m)``: keep ``n`` of every ``m`` consecutive inputs of each row, e.g. ``(2, 4)``.
        scope: ``"layer"`` (published SparseGPT) or ``"row"``; ignored with ``nm``.
        blocksize: columns per block (mask selection and lazy batch updates), 128 in the original.
        damp: relative dampening, ``damp * mean(diag H)`` is added to the diagonal (``percdamp``).
        update_weights: False returns the same mask with the original weights, ``weight * keep_mask``
            (a mask-only warmstart).
        dtype: computation dtype, ``torch.float32`` (the original) or ``torch.float64``.
        keep_mask: ``[d_out, d_in]`` bool mask to use instead of selecting one (``sparsity``/``nm``/``scope``
            are then ignored): SparseGPT's OBS weight update on a given mask, e.g. a refined one. Given
            SparseGPT's own mask it reproduces SparseGPT's weights (the updates depend only on the mask).

    Returns:
        :class:`SparseGPTResult` with the new weight (``weight``'s dtype and device) and the bool mask.

    Raises:
        ValueError: bad shapes, NaN, an empty Gram, a bad budget, ``blocksize`` or ``damp``, or a failed
            Cholesky factorization (raise ``damp``).
        TypeError: non-tensor or non-float inputs, a bad ``dtype``.

    Example:
        >>> res = sparsegpt_prune(layer.weight, acc.gram, sparsity=0.6)
        >>> layer.weight.data.copy_(res.weight)
    """
    check_weight(weight)
    d_out, d_in = weight.shape
    check_gram(gram, d_in)
    if keep_mask is not None:
        check_mask(keep_mask, weight)
        sparsity, nm = 0.0, None
    check_budget(sparsity, nm, d_in)
    if scope not in ("layer", "row"):
        raise ValueError(f"scope must be 'layer' or 'row', got {scope!r}")
    if isinstance(blocksize, bool) or not isinstance(blocksize, int) or blocksize < 1:
        raise ValueError(f"blocksize must be an int >= 1 (128 in SparseGPT), got {blocksize!r}")
    if nm is not None and blocksize % nm[1] != 0:
        raise ValueError(
            f"blocksize={blocksize} must be a multiple of m={nm[1]} so that N:M groups do not straddle blocks; "
            f"use e.g. blocksize={nm[1] * max(1, 128 // nm[1])}"
        )
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not damp >= 0:
        raise ValueError(f"damp must be a float >= 0 (0.01 in SparseGPT), got {damp!r}")
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")

    w = weight.detach().to(dtype=dtype).clone()
    hessian = gram.detach().to(device=w.device, dtype=dtype).clone()
    dead = torch.diagonal(hessian) == 0
    hessian[dead, dead] = 1
    w[:, dead] = 0
    hinv = _upper_cholesky_of_inverse(hessian, damp)

    if nm is not None:
        counts = None
    else:
        units = d_out if scope == "layer" else 1
        counts = _pruned_per_block(sparsity, d_in, blocksize, units)
    keep = torch.ones(d_out, d_in, dtype=torch.bool, device=w.device)
    for b, i1 in enumerate(range(0, d_in, blocksize)):
        i2 = min(i1 + blocksize, d_in)
        count = i2 - i1
        w1 = w[:, i1:i2].clone()
        q1 = torch.zeros_like(w1)
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        d1 = torch.diagonal(hinv1)
        if keep_mask is not None:
            keep1 = keep_mask[:, i1:i2].to(w.device).clone()
        elif counts is not None:
            scores = w1**2 / d1.reshape(1, -1) ** 2
            if scope == "layer":
                keep1 = keep_top(scores.reshape(1, -1), scores.numel() - counts[b]).reshape(d_out, count)
            else:
                keep1 = keep_top(scores, count - counts[b])
        else:
            keep1 = torch.ones(d_out, count, dtype=torch.bool, device=w.device)
        for i in range(count):
            col = w1[:, i]
            d = hinv1[i, i]
            if nm is not None and i % nm[1] == 0:
                m = nm[1]
                scores = w1[:, i : i + m] ** 2 / d1[i : i + m].reshape(1, -1) ** 2
                keep1[:, i : i + m] = keep_top(scores, nm[0])
            q = torch.where(keep1[:, i], col, 0.0)
            q1[:, i] = q
            e = (col - q) / d
            w1[:, i:] -= e.unsqueeze(1).matmul(hinv1[i, i:].unsqueeze(0))
            err1[:, i] = e
        w[:, i1:i2] = q1
        keep[:, i1:i2] = keep1
        w[:, i2:] -= err1.matmul(hinv[i1:i2, i2:])

    out = w.to(weight.dtype) if update_weights else torch.where(keep, weight.detach(), 0.0)
    return SparseGPTResult(weight=out, keep_mask=keep)


def _pruned_per_block(sparsity: float, d_in: int, blocksize: int, units: int) -> list[int]:
    """Weights pruned in each block of columns, ``round(s * units * end) - round(s * units * start)``.

    ``units`` is ``d_out`` for one count over the block's rows or 1 for a count per row; the counts sum to
    ``round(sparsity * units * d_in)``.
    """
    edges = [min(end, d_in) for end in range(0, d_in + blocksize, blocksize)]
    cumulative = [round(sparsity * (units * end)) for end in edges]
    return [b - a for a, b in itertools.pairwise(cumulative)]


def _upper_cholesky_of_inverse(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """``chol(inv(H + damp * mean(diag H) I), upper=True)``; ``hessian`` is dampened in place."""
    diag = torch.arange(hessian.shape[0], device=hessian.device)
    hessian[diag, diag] += damp * torch.mean(torch.diag(hessian))  # a contiguous copy, summed as the original sums it
    factor, info = torch.linalg.cholesky_ex(hessian)
    if int(info) == 0:
        factor, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(factor), upper=True)
    if int(info) != 0:
        raise ValueError(
            f"SparseGPT's Cholesky factorization failed (the dampened Hessian is not positive definite at "
            f"order {int(info)}; collinear or too few calibration inputs); raise damp (got damp={damp}), "
            "e.g. damp=0.1, or compute in dtype=torch.float64"
        )
    return factor
