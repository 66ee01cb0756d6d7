"""DSnoT (Zhang et al. 2024, "Dynamic Sparse No Training"): training-free prune-and-regrow mask refinement.

A vectorized transcription of ``prune_DSnoT`` from github.com/zyxxmu/DSnoT (``lib/prune.py``, statistics
from ``lib/layerwrapper.py``). Each row ``i`` tracks the expected reconstruction error of its pruned
weights, ``e_i = sum_{j pruned} w_ij mu_j`` (``mu`` the input means). Every cycle, each active row

* regrows a pruned weight that moves ``e_i`` towards 0: the next one from the pruned weights sorted by
  ``w_ij mu_j / var_j ** pow_of_var_regrowing``, the most positive when ``e_i > 0`` and the most negative
  otherwise;
* prunes a kept weight: unstructured, the kept weight of lowest Wanda score ``|w_ij| sqrt(E[x_j^2])``
  among those whose ``w_ij mu_j`` has the opposite sign of ``e_i`` (positive when ``e_i < 0``, negative
  otherwise); N:M, the kept weight of lowest score in the regrown weight's block of ``m`` (weights
  regrown or pruned during the refinement are never candidates again);
* applies the pair when ``|e_i| > update_threshold`` (and, when the sign check is on, when the new error
  keeps the sign of the initial one); otherwise the row stops for good.

Rows are independent and processed together; the loop runs over cycles. Weights are never changed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sparseswaps_prune.core.checks import check_budget, check_mask, check_weight
from sparseswaps_prune.core.refine import check_nm_mask


@dataclass
class DSnoTResult:
    """Outcome of :func:`dsnot_refine`.

    Attributes:
        mask: ``[d_out, d_in]`` bool refined mask (True = kept) on the weight's device; every row keeps its
            count (and every N:M block its ``n``).
        n_cycles: cycles run (at most ``max_cycles``; the loop ends early once every row has stopped).
        n_updates: ``[d_out]`` int64 prune-and-regrow pairs applied to each row.
        error_before: ``[d_out]`` float64 expected reconstruction error ``sum_{j pruned} w_ij mu_j`` of the
            input mask (signed; recomputed in float64).
        error_after: ``[d_out]`` float64, the same for ``mask``.
    """

    mask: torch.Tensor
    n_cycles: int
    n_updates: torch.Tensor
    error_before: torch.Tensor
    error_after: torch.Tensor


def dsnot_refine(
    weight: torch.Tensor,
    keep_mask: torch.Tensor,
    *,
    feature_mean: torch.Tensor,
    feature_var: torch.Tensor,
    feature_sq_mean: torch.Tensor | None = None,
    prune_scores: torch.Tensor | None = None,
    nm: tuple[int, int] | None = None,
    max_cycles: int = 50,
    update_threshold: float = 0.1,
    pow_of_var_regrowing: float = 1.0,
    without_same_sign: bool | None = None,
    dtype: torch.dtype = torch.float32,
) -> DSnoTResult:
    """Refine a pruning mask with DSnoT (mask only; weights are not updated).

    Statistics: the original's ``DSnoT_metric = W * sum_metric_row`` with ``sum_metric_row = sum_t x_t /
    n_samples`` (a sum over calibration *sequences*, i.e. ``seqlen`` times the per-token mean), and its
    ``update_threshold = 0.1`` is on that scale. Pass ``feature_mean`` from
    ``GramAccumulator.feature_stats(n_samples=nsamples)`` to use the threshold as published; with per-token
    means (``n_samples=None``) the same masks need ``update_threshold / seqlen``. Only the threshold depends
    on these scales: ``feature_var`` and ``feature_sq_mean`` enter through orderings.

    Deviations from the original, none of which changes a result while every row still has candidates:
    a row whose candidate list of the needed sign is exhausted (or, N:M, whose regrown weight's block has no
    kept weight left that was there from the start) stops, where the original would index past the list
    and could change row counts; ``var_j = 0`` gives ``0 / 0 -> 0`` (not NaN) in the regrowing order; ties
    in the N:M block choice go to the lowest index (``argmin``, the original ``topk`` leaves them open).
    The original's ``pow_of_var_pruning`` argument is never read by its code, so there is none here.

    Args:
        weight: ``[d_out, d_in]`` float tensor (not modified).
        keep_mask: ``[d_out, d_in]`` bool warmstart mask, True = kept (not modified). Unstructured rows may
            keep different counts; with ``nm`` it must follow the N:M pattern.
        feature_mean: ``[d_in]`` mean of each input over the calibration tokens (``mu``; see scale above).
        feature_var: ``[d_in]`` variance of each input (``>= 0``), for the regrowing order.
        feature_sq_mean: ``[d_in]`` ``E[x_j^2]`` (any positive scale) for the default Wanda pruning score
            ``|w_ij| sqrt(E[x_j^2])``; exclusive with ``prune_scores``.
        prune_scores: ``[d_out, d_in]`` score choosing which kept weight to prune (lowest first) instead of
            Wanda. The original uses Wanda in its unstructured branch and the warmstart's own score
            (``initial_method``: Wanda, magnitude or SparseGPT's ``w^2 / [H^-1]_jj^2``) in its N:M branch.
        nm: ``(n, m)``: keep ``n`` of every ``m`` consecutive inputs (the original's N:M branch, where
            ``prune_n = m - n`` are pruned; ``2:4`` and ``4:8`` read the same both ways).
        max_cycles: at most this many cycles (``max_cycle_time``, 50).
        update_threshold: a row stops once ``|e_i| <= update_threshold`` (0.1).
        pow_of_var_regrowing: power of the variance dividing the regrowing score (1; 0 = no division).
        without_same_sign: False requires the error after each update to keep the sign of the row's initial
            error; True drops that check. None (default) is what the original does: no check unstructured
            (its ``--without_same_sign`` defaults to True), always the check for N:M (that branch has no flag).
        dtype: computation dtype, ``torch.float32`` (the original) or ``torch.float64``.

    Returns:
        :class:`DSnoTResult` with the refined mask on ``weight``'s device.

    Raises:
        ValueError: bad shapes, NaN/Inf or negative statistics, a mask off the N:M pattern, bad settings.
        TypeError: non-tensor or non-float inputs, a non-bool mask, a bad ``dtype``.

    Example:
        >>> mean, var, sq_mean = acc.feature_stats(n_samples=128)
        >>> mask = warmstart_mask(w, "wanda", sparsity=0.6, gram=acc.gram)
        >>> res = dsnot_refine(w, mask, feature_mean=mean, feature_var=var, feature_sq_mean=sq_mean)
    """
    check_weight(weight)
    d_out, d_in = weight.shape
    check_mask(keep_mask, weight)
    if nm is not None:
        check_budget(None, nm, d_in)
        check_nm_mask(keep_mask, nm)
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    if isinstance(max_cycles, bool) or not isinstance(max_cycles, int) or max_cycles < 0:
        raise ValueError(f"max_cycles must be an int >= 0 (50 in DSnoT), got {max_cycles!r}")
    if not _is_real(update_threshold) or not update_threshold >= 0 or math.isinf(update_threshold):
        raise ValueError(f"update_threshold must be a finite float >= 0 (0.1 in DSnoT), got {update_threshold!r}")
    if not _is_real(pow_of_var_regrowing) or not math.isfinite(pow_of_var_regrowing):
        raise ValueError(f"pow_of_var_regrowing must be a finite float (1 in DSnoT), got {pow_of_var_regrowing!r}")
    if without_same_sign is not None and not isinstance(without_same_sign, bool):
        raise TypeError(f"without_same_sign must be True, False or None, got {without_same_sign!r}")
    device = weight.device
    mean = _check_stat(feature_mean, d_in, "feature_mean", device, dtype)
    var = _check_stat(feature_var, d_in, "feature_var", device, dtype, nonnegative=True)
    if (feature_sq_mean is None) == (prune_scores is None):
        raise ValueError(
            "give exactly one of feature_sq_mean= (E[x^2] per input, for DSnoT's Wanda pruning score) or "
            "prune_scores= ([d_out, d_in] scores), not both or neither"
        )
    w = weight.detach().to(dtype)
    if prune_scores is None:
        sq_mean = _check_stat(feature_sq_mean, d_in, "feature_sq_mean", device, dtype, nonnegative=True)
        scores = w.abs() * torch.sqrt(sq_mean).reshape(1, -1)
    else:
        check_weight(prune_scores, what="prune_scores")
        if prune_scores.shape != weight.shape:
            raise ValueError(
                f"prune_scores shape {tuple(prune_scores.shape)} does not match the weight's {tuple(weight.shape)}"
            )
        scores = prune_scores.detach().to(device=device, dtype=dtype)
    sign_check = (nm is not None) if without_same_sign is None else not without_same_sign

    keep = keep_mask.detach().to(device).clone()
    metric = w * mean.reshape(1, -1)  # DSnoT_metric: each weight's share of the expected output error
    error_before = _expected_error(weight, feature_mean, keep)
    n_updates = torch.zeros(d_out, dtype=torch.long, device=device)
    if d_out == 0 or d_in == 0:
        return DSnoTResult(keep, 0, n_updates.cpu(), error_before, error_before.clone())

    regrow_metric = torch.where(keep, 0.0, metric)
    error = regrow_metric.sum(dim=1)
    initial_sign = torch.sign(error)
    if pow_of_var_regrowing:
        divided = regrow_metric / torch.pow(var, pow_of_var_regrowing).reshape(1, -1)
        regrow_metric = torch.where(regrow_metric == 0, 0.0, divided)  # var = 0: 0 / 0 -> 0, not NaN
    # regrowing: pruned weights sorted ascending; most negative at the front, most positive at the back
    regrow_order = torch.sort(regrow_metric, dim=1, stable=True).indices
    n_regrow_neg = (regrow_metric < 0).sum(dim=1)
    n_regrow_pos = (regrow_metric > 0).sum(dim=1)
    regrow_front = torch.zeros(d_out, dtype=torch.long, device=device)
    regrow_back = torch.full((d_out,), d_in - 1, dtype=torch.long, device=device)

    if nm is None:
        # pruning: kept weights of each sign of metric, lowest score first (the original's reordered list)
        inf = torch.tensor(float("inf"), dtype=dtype, device=device)
        neg, pos = keep & (metric < 0), keep & (metric > 0)
        prune_neg = torch.sort(torch.where(neg, scores, inf), dim=1, stable=True).indices
        prune_pos = torch.sort(torch.where(pos, scores, inf), dim=1, stable=True).indices
        n_prune_neg, n_prune_pos = neg.sum(dim=1), pos.sum(dim=1)
        next_neg = torch.zeros(d_out, dtype=torch.long, device=device)
        next_pos = torch.zeros(d_out, dtype=torch.long, device=device)
    else:
        m = nm[1]
        # kept weights still eligible for pruning; pruned and regrown weights are +inf (W_metric_max_value)
        prune_key = torch.where(keep, scores, float("inf"))
        block_offsets = torch.arange(m, device=device)

    rows = torch.arange(d_out, device=device)
    active = torch.ones(d_out, dtype=torch.bool, device=device)
    n_cycles = 0
    while n_cycles < max_cycles and bool(active.any()):
        n_cycles += 1
        # regrowing
        from_back = error > 0
        position = torch.where(from_back, regrow_back, regrow_front)
        regrow_ok = torch.where(from_back, position >= d_in - n_regrow_pos, position < n_regrow_neg)
        regrow_idx = regrow_order.gather(1, position.clamp(0, d_in - 1)[:, None]).squeeze(1)
        regrow_back -= (from_back & active).long()
        regrow_front += (~from_back & active).long()
        regrow_value = metric[rows, regrow_idx]
        # pruning
        if nm is None:
            positive = error < 0
            pick = torch.where(positive, next_pos, next_neg).clamp_max(d_in - 1)[:, None]
            prune_idx = torch.where(
                positive, prune_pos.gather(1, pick).squeeze(1), prune_neg.gather(1, pick).squeeze(1)
            )
            prune_ok = torch.where(positive, next_pos < n_prune_pos, next_neg < n_prune_neg)
            next_pos += (positive & active).long()
            next_neg += (~positive & active).long()
        else:
            block = (regrow_idx - regrow_idx % m)[:, None] + block_offsets
            block_key = prune_key.gather(1, block)
            best = block_key.argmin(dim=1)
            prune_idx = block.gather(1, best[:, None]).squeeze(1)
            prune_ok = torch.isfinite(block_key.gather(1, best[:, None]).squeeze(1))
        prune_value = metric[rows, prune_idx]
        # change the mask
        error_after = error + prune_value - regrow_value
        update = active & (error.abs() > update_threshold) & regrow_ok & prune_ok
        if sign_check:
            update &= initial_sign == torch.sign(error_after)
        done = rows[update]
        keep[done, prune_idx[update]] = False
        keep[done, regrow_idx[update]] = True
        if nm is not None:
            prune_key[done, prune_idx[update]] = float("inf")
        error = torch.where(update, error_after, error)
        n_updates += update.long()
        active = update
    return DSnoTResult(keep, n_cycles, n_updates.cpu(), error_before, _expected_error(weight, feature_mean, keep))


def _expected_error(weight: torch.Tensor, mean: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``[d_out]`` float64 ``sum_{j pruned} w_ij mu_j`` on the CPU."""
    return (torch.where(keep, 0.0, weight.detach().double()) @ mean.detach().to(keep.device).double()).cpu()


def _is_real(value: object) -> bool:
    """True for an int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_stat(
    stat: torch.Tensor,
    d_in: int,
    what: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    nonnegative: bool = False,
) -> torch.Tensor:
    """Validate a per-input statistic ``[d_in]`` and return it as ``dtype`` on ``device``."""
    hint = "compute it with GramAccumulator(d_in, track_sum=True) and .feature_stats()"
    if not isinstance(stat, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor [d_in], got {type(stat).__name__}; {hint}")
    if not stat.is_floating_point():
        raise TypeError(f"{what} must be a floating-point tensor, got dtype {stat.dtype}")
    if stat.shape != (d_in,):
        raise ValueError(
            f"{what} must have shape [d_in] = [{d_in}] to match the weight's input width, got {tuple(stat.shape)}"
        )
    if not bool(torch.isfinite(stat).all()):
        raise ValueError(f"{what} contains NaN or Inf; check the calibration activations (fp16 overflow?)")
    if nonnegative and bool((stat < 0).any()):
        raise ValueError(f"{what} must be >= 0, got a minimum of {float(stat.min())}; {hint}")
    return stat.detach().to(device=device, dtype=dtype)
