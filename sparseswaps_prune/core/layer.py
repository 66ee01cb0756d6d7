"""The per-layer seam: :func:`prune_layer` runs one layer's stages (start -> refine -> weights) from a
:class:`~sparseswaps_prune.core.spec.PruneSpec` and returns a :class:`LayerOutcome`.

It validates the tensors once, then composes the stages through their one method each
(:mod:`~sparseswaps_prune.core.stages`: ``select``, ``refine``, ``fit``), checks that no stage returned a
non-finite weight and applies the held-out guard; it knows no stage by type.

Every entry point (the Hugging Face pipeline, the torch prune method, the Lightning callback) calls this one
function and writes what it returns; none re-implements a stage or recomputes a loss. Tensors in, tensors out:
no module, no I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sparseswaps_prune.core.checks import (
    check_budget,
    check_device,
    check_finite_weights,
    check_gram,
    check_keeps_some,
    check_mask,
    check_weight,
)
from sparseswaps_prune.core.losses import weight_losses_unchecked
from sparseswaps_prune.core.spec import SPARSESWAPS_SPEC, PruneSpec
from sparseswaps_prune.core.stages import FeatureStats, StageContext, mask_losses

__all__ = ["FeatureStats", "LayerOutcome", "StageLosses", "prune_layer"]


@dataclass
class StageLosses:
    """Per-row losses ``sum_t ((w - w') x_t)^2`` of each stage on one Gram, ``[d_out]`` float64 on the CPU.

    Attributes:
        start: the start mask with the original weights (pruned weights zeroed).
        refined: the refined (final) mask with the original weights.
        final: the final weights (the refined mask with the weight stage's weights; equals ``refined`` when the
            weights are kept).
    """

    start: torch.Tensor
    refined: torch.Tensor
    final: torch.Tensor


@dataclass
class LayerOutcome:
    """What :func:`prune_layer` returns; the caller writes ``keep_mask`` (and ``weight``) into its model.

    Attributes:
        keep_mask: ``[d_out, d_in]`` bool final mask (True = kept), on the weight's device.
        start_mask: ``[d_out, d_in]`` bool mask of the start stage.
        weight: ``[d_out, d_in]`` final weights (the input weight's dtype and device, exactly zero off
            ``keep_mask``) when the spec updates weights; None when the kept weights stay as they are.
        loss: the stages' losses on the calibration Gram.
        holdout: the same on the held-out Gram (None without one). Sums over the held-out tokens: scale by
            (calibration tokens / held-out tokens) to compare with ``loss``.
        n_swaps: ``[d_out]`` int64 moves (SparseSwaps) or updates (DSnoT) per row; zeros without refinement.
        iters: iterations (cycles for DSnoT) that changed the mask.
        updated_rows: fraction of rows that keep the weight update (below 1 only when the held-out guard rejects
            some); None when the weights are kept.
        seconds_mask: time of the start and refine stages; seconds_weights: time of the weight stage.
        row_updated: ``[d_out]`` bool CPU, the rows that keep the weight update (``updated_rows`` is its mean);
            None when the weights are kept.
    """

    keep_mask: torch.Tensor
    start_mask: torch.Tensor
    weight: torch.Tensor | None
    loss: StageLosses
    holdout: StageLosses | None
    n_swaps: torch.Tensor
    iters: int
    updated_rows: float | None
    seconds_mask: float
    seconds_weights: float
    row_updated: torch.Tensor | None = None

    @classmethod
    def cat(cls, parts: list[LayerOutcome]) -> LayerOutcome:
        """The outcome of a layer from the outcomes of consecutive slices of its rows (row shards, in row order): the
        per-row tensors concatenated (on the CPU), ``iters`` the largest (every row stage counts the iterations of
        its busiest row), the times summed. A stage that treats rows apart
        (:attr:`~sparseswaps_prune.core.spec.PruneSpec.row_separable`) gives the whole layer's outcome this way."""
        if len(parts) == 1:
            return parts[0]

        def cat(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if tensors[0] is None else torch.cat([t.cpu() for t in tensors])

        def losses(stages: list[StageLosses | None]) -> StageLosses | None:
            if stages[0] is None:
                return None
            return StageLosses(*(cat([getattr(s, f) for s in stages]) for f in ("start", "refined", "final")))

        row_updated = cat([p.row_updated for p in parts])
        return cls(
            keep_mask=cat([p.keep_mask for p in parts]),
            start_mask=cat([p.start_mask for p in parts]),
            weight=cat([p.weight for p in parts]),
            loss=losses([p.loss for p in parts]),
            holdout=losses([p.holdout for p in parts]),
            n_swaps=cat([p.n_swaps for p in parts]),
            iters=max(p.iters for p in parts),
            updated_rows=None if row_updated is None else _mean(row_updated),
            seconds_mask=sum(p.seconds_mask for p in parts),
            seconds_weights=sum(p.seconds_weights for p in parts),
            row_updated=row_updated,
        )


def _mean(row_updated: torch.Tensor) -> float:
    """``LayerOutcome.updated_rows`` of its ``row_updated``."""
    return float(row_updated.double().mean())


def prune_layer(
    weight: torch.Tensor,
    gram: torch.Tensor,
    spec: PruneSpec = SPARSESWAPS_SPEC,
    *,
    holdout_gram: torch.Tensor | None = None,
    prior_mask: torch.Tensor | None = None,
    feature_stats: FeatureStats | None = None,
    name: str | None = None,
    device: torch.device | str | None = None,
) -> LayerOutcome:
    """Prune one linear layer: start mask, refined mask, final weights (with the held-out guard).

    Args:
        weight: ``[d_out, d_in]`` float weights (not modified).
        gram: ``[d_in, d_in]`` Gram ``sum_t x_t x_t^T`` of the layer's calibration inputs (not modified).
        spec: the stages (default :data:`~sparseswaps_prune.core.spec.SPARSESWAPS_SPEC`: ADMM's mask, 25 exact 1-swap
            iterations per row, the weights kept; a named method: ``RECIPES[name].spec``).
        holdout_gram: ``[d_in, d_in]`` Gram of held-out calibration inputs: every stage's loss is also reported on
            it, and a guarded weight update is kept only in rows where it lowers the held-out loss.
        prior_mask: ``[d_out, d_in]`` bool mask of an already pruned tensor: the new mask prunes
            ``spec.budget.sparsity`` of each row's remaining weights and is a subset of it.
        feature_stats: ``(mean, var, sq_mean)`` ``[d_in]`` input statistics
            (``GramAccumulator.feature_stats``), needed by :class:`~sparseswaps_prune.core.spec.DSnoTRefine`.
        name: the layer's name, for error messages and ``DSnoTRefine.skip``.
        device: where refinement and weight updates run (default: the weight's device).

    Returns:
        :class:`LayerOutcome`.

    Raises:
        ValueError / TypeError: bad input, prefixed with ``layer <name>:``; raised before any work where they can
            be checked up front (shapes, NaN, budget vs width), else from the stage that fails (e.g. a singular
            Gram block: raise the damp); a stage whose weights are not all finite, naming the stage, the rows and
            the cause (e.g. weights too large for its arithmetic), before the caller can write any of them.

    Example:
        >>> out = prune_layer(layer.weight, acc.gram, build_spec(sparsity=0.5))
        >>> out.loss.final.sum() <= out.loss.start.sum()
        True
    """
    try:
        return _prune_layer(weight, gram, spec, holdout_gram, prior_mask, feature_stats, name, device)
    except (ValueError, TypeError) as err:
        if name is None:
            raise
        raise type(err)(f"layer {name}: {err}") from None


def _prune_layer(
    weight: torch.Tensor,
    gram: torch.Tensor,
    spec: PruneSpec,
    holdout_gram: torch.Tensor | None,
    prior_mask: torch.Tensor | None,
    feature_stats: FeatureStats | None,
    name: str | None,
    device: torch.device | str | None,
) -> LayerOutcome:
    if not isinstance(spec, PruneSpec):
        raise TypeError(f"spec must be a PruneSpec (e.g. build_spec(...)), got {type(spec).__name__}")
    # every input is validated here, once; the stages trust them (the spec validated itself when built)
    check_weight(weight)
    check_gram(gram, weight.shape[1])
    if device is not None:
        check_device(device)
    budget = spec.budget
    check_budget(budget.sparsity, budget.nm, weight.shape[1])
    if budget.scope == "row":
        check_keeps_some(budget.sparsity, weight.shape[1], "each row")
    else:
        check_keeps_some(budget.sparsity, weight.numel(), "the layer")
    if holdout_gram is not None:
        check_gram(holdout_gram, weight.shape[1], what="holdout_gram")
    weight = weight.detach()  # a Parameter's graph must not reach the outcome's losses
    if prior_mask is not None:
        check_mask(prior_mask, weight, what="prior_mask")
        prior_mask = None if bool(prior_mask.all()) else prior_mask  # dense: nothing pruned yet
    if prior_mask is not None:
        weight = torch.where(prior_mask, weight, 0.0)
    ctx = StageContext(spec.weights, prior_mask, feature_stats, name, device)
    for stage in spec.stages:
        stage.check_inputs(weight, budget, ctx)

    started = time.perf_counter()
    start, start_weight = spec.start.select(weight, gram, budget, ctx)
    refined = spec.refine.refine(weight, gram, start, budget, ctx)
    mask = refined.mask if prior_mask is None else refined.mask & prior_mask
    seconds_mask = time.perf_counter() - started

    final = spec.weights.fit(weight, gram, mask, ctx, start_weight=start_weight, refined_weight=refined.weight)
    check_finite_weights(  # before anything is written
        weight, gram, [(role, stage.name, tensor) for role, stage, tensor in zip(
            ("start", "refine", "weight"), spec.stages, (start_weight, refined.weight, final), strict=True
        )],
    )  # fmt: skip
    holdout, row_updated = None, None if final is None else torch.ones(weight.shape[0], dtype=torch.bool)
    if holdout_gram is not None:
        held_refined = mask_losses(weight, holdout_gram, mask)
        held_final = held_refined
        if final is not None:
            held_final = weight_losses_unchecked(weight, final, holdout_gram)
            if spec.weights.guard:
                # a row rejecting the update keeps the start's weights where its mask is still the start's (ADMM,
                # ALPS, SparseGPT compensate), else its original weights on the mask
                fallback, held_fallback = torch.where(mask, weight, 0.0), held_refined
                if start_weight is not None and not spec.weights.keeps_start_weights:
                    unchanged = (mask == start).all(dim=1)
                    fallback[unchanged] = start_weight[unchanged].to(fallback.dtype)
                    held_fallback = weight_losses_unchecked(weight, fallback, holdout_gram)
                better = held_final < held_fallback
                final = torch.where(better[:, None], final, fallback)
                held_final = torch.where(better, held_final, held_fallback)
                row_updated = better.cpu()
        holdout = StageLosses(
            start=mask_losses(weight, holdout_gram, start).cpu(), refined=held_refined.cpu(), final=held_final.cpu()
        )
    loss_final = refined.loss_refined if final is None else weight_losses_unchecked(weight, final, gram)
    return LayerOutcome(
        keep_mask=mask,
        start_mask=start,
        weight=final,
        loss=StageLosses(refined.loss_start.cpu(), refined.loss_refined.cpu(), loss_final.cpu()),
        holdout=holdout,
        n_swaps=refined.n_swaps.cpu(),
        iters=refined.iters,
        updated_rows=None if row_updated is None else _mean(row_updated),
        seconds_mask=seconds_mask,
        seconds_weights=time.perf_counter() - started - seconds_mask,
        row_updated=row_updated,
    )
