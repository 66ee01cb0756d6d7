"""Sparsity budgets across decoder blocks: OWL's non-uniform layerwise sparsity (tensors in, floats out).

OWL (Yin et al. 2023, "Outlier Weighed Layerwise Sparsity (OWL)", arXiv 2310.05175; code
``github.com/luuyin/OWL``, ``lib/prune_all.py``: ``check_outlier_mean`` and ``prune_wanda_outlier``; the same
formula is llm-compressor's ``sparsity_profile="owl"``, ``_infer_owl_layer_sparsity`` with ``owl_m``,
``owl_lmbda``) prunes a decoder block less the more outliers its Wanda scores have:

1. block ``l``'s outlier ratio ``D_l`` (:func:`outlier_ratio`) is the fraction of the Wanda scores
   ``|W_ij| * ||X_j||`` of all its pruned layers, taken together, greater than ``M`` times their mean;
2. ``r = (D - min D) / (max D - min D) * 2 * lambda``, ``r = r - mean(r) + (1 - target)`` and block ``l`` is
   pruned at sparsity ``1 - r_l`` (:func:`owl_sparsities`): the mean over blocks is ``target``, and the sparsities
   span at most ``2 * lambda``.

Deliberate differences from OWL's code, none of which changes its result where it has one: ``D`` is a fraction,
not a percentage (the min-max normalisation removes the scale); ``||X_j||`` is the root of the summed, not the
mean, squared input norms (a common factor of every score, which the ratio to the mean removes); the mean is
taken in float64 over the layers one at a time instead of a float32 ``torch.mean`` of the concatenated scores;
equal ``D`` in every block gives the uniform budget instead of OWL's division by zero; and a sparsity outside
``[0, 1)`` raises (naming the largest ``lambda`` that fits) instead of OWL's silent floor of 0.01.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from sparseswaps_prune.core.checks import check_number, check_positive

PROFILES = ("uniform", "owl")
OWL_M = 5.0
"""OWL's default outlier threshold ``M`` (scores above ``M`` times the block's mean are outliers)."""
OWL_LAMBDA = 0.08
"""OWL's default ``lambda``: block sparsities span at most ``2 * lambda`` around the target."""


def outlier_ratio(weights: Sequence[torch.Tensor], input_sq_norms: Sequence[torch.Tensor], m: float) -> float:
    """OWL's layerwise outlier distribution ``D_l`` of one block: the fraction of the Wanda scores
    ``|W_ij| * sqrt(input_sq_norms_j)`` of all its layers, taken together, that exceed ``m`` times their mean.

    Args:
        weights: each layer's ``[d_out, d_in]`` weights (any float dtype and device); not modified.
        input_sq_norms: each layer's ``[d_in]`` summed squared inputs ``sum_t x_tj^2`` (the Gram diagonal), on the
            device of its weights; not modified.
        m: the threshold ``M`` (``owl_m``), > 0.

    Returns:
        ``D_l`` in ``[0, 1]``.

    Raises:
        ValueError: no layer, mismatched shapes, a non-finite score or ``m <= 0``.
    """
    check_owl_m(m)
    if len(weights) == 0 or len(weights) != len(input_sq_norms):
        raise ValueError(
            f"outlier_ratio needs one [d_in] input norm per [d_out, d_in] weight and at least one layer, got "
            f"{len(weights)} weights and {len(input_sq_norms)} norms"
        )
    for weight, sq_norms in zip(weights, input_sq_norms, strict=True):
        if weight.dim() != 2 or tuple(sq_norms.shape) != (weight.shape[1],):
            raise ValueError(
                f"weight {tuple(weight.shape)} and input norms {tuple(sq_norms.shape)} do not fit: expected "
                "[d_out, d_in] and [d_in]"
            )

    def scores(j: int) -> torch.Tensor:  # one layer's at a time: a block's scores together can be large
        return weights[j].double().abs() * input_sq_norms[j].double().clamp(min=0).sqrt()

    total, count = sum(float(scores(j).sum()) for j in range(len(weights))), sum(w.numel() for w in weights)
    if not math.isfinite(total):
        raise ValueError("the Wanda scores of the block are not finite (NaN or inf weights or inputs)")
    threshold = m * total / count
    return sum(int((scores(j) > threshold).sum()) for j in range(len(weights))) / count


def owl_sparsities(outlier_ratios: Sequence[float], target: float, lam: float) -> list[float]:
    """OWL's per-block sparsities from the blocks' outlier ratios ``D`` (:func:`outlier_ratio`).

    ``r = (D - min D) / (max D - min D) * 2 * lam``, then ``r - mean(r) + (1 - target)`` is each block's kept
    fraction: block ``l`` gets sparsity ``target - r_l + mean(r)``, their mean is ``target``, and the block with
    the most outliers is pruned least. Equal ratios (or ``lam = 0``) give ``target`` everywhere.

    Args:
        outlier_ratios: ``D_l`` per block, each in ``[0, 1]``.
        target: the mean sparsity (``sparsity``), in ``[0, 1)``.
        lam: ``lambda`` (``owl_lambda``), >= 0.

    Returns:
        One sparsity per block, each in ``[0, 1)``.

    Raises:
        ValueError: no block, a ratio outside ``[0, 1]``, ``target`` outside ``[0, 1)``, ``lam < 0``, or a ``lam``
            that puts some block's sparsity outside ``[0, 1)`` (naming the largest that fits).
    """
    check_number(target, "sparsity", low=0.0, high=1.0, high_open=True)
    check_number(lam, "owl_lambda", low=0.0)
    if len(outlier_ratios) == 0:
        raise ValueError("owl_sparsities needs the outlier ratio of at least one block")
    ratios = [check_number(d, "outlier ratio", low=0.0, high=1.0) for d in outlier_ratios]
    low, high = min(ratios), max(ratios)
    if high == low or lam == 0:
        return [float(target)] * len(ratios)
    unit = [(d - low) / (high - low) for d in ratios]  # in [0, 1]; r = 2 * lam * unit
    mean_unit = sum(unit) / len(unit)
    sparsities = [target - 2 * lam * (u - mean_unit) for u in unit]
    if min(sparsities) < 0 or max(sparsities) >= 1:
        # the extremes are at unit 1 (target - 2 lam (1 - mean)) and unit 0 (target + 2 lam mean)
        fits = min(target / (2 * (1 - mean_unit)), (1 - target) / (2 * mean_unit))
        raise ValueError(
            f"owl_lambda={lam} gives block sparsities from {min(sparsities):.4g} to {max(sparsities):.4g} around "
            f"sparsity={target}, outside [0, 1); use owl_lambda below {fits:.4g} (or another sparsity)"
        )
    return sparsities


def check_owl_m(m: float) -> None:
    """Raise naming ``owl_m`` unless ``m`` is a finite number > 0."""
    check_positive(m, "owl_m", note="scores above owl_m times the mean are outliers")
