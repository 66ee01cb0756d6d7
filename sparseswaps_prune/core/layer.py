"""The per-layer seam: :func:`prune_layer` runs one layer's stages (start -> refine -> weights) from a
:class:`~sparseswaps_prune.core.spec.PruneSpec` and returns a :class:`LayerOutcome`.

Every entry point (the Hugging Face pipeline, the torch prune method, the Lightning callback) calls this one
function and writes what it returns; none re-implements a stage or recomputes a loss. Tensors in, tensors out:
no module, no I/O.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sparseswaps_prune.core.admm import admm_prune, admm_update
from sparseswaps_prune.core.alps import alps_prune, alps_update
from sparseswaps_prune.core.checks import (
    check_budget,
    check_device,
    check_gram,
    check_keeps_some,
    check_mask,
    check_weight,
)
from sparseswaps_prune.core.dsnot import dsnot_refine
from sparseswaps_prune.core.losses import row_losses, weight_losses
from sparseswaps_prune.core.refine import refine_mask
from sparseswaps_prune.core.refit import refit_weights
from sparseswaps_prune.core.select import keep_top, select_mask
from sparseswaps_prune.core.sparsegpt import sparsegpt_prune
from sparseswaps_prune.core.spec import (
    SPARSESWAPS_SPEC,
    ADMMStart,
    ADMMUpdate,
    ALPSUpdate,
    DSnoTRefine,
    LeastSquares,
    OBSUpdate,
    PruneSpec,
    ScoreStart,
    SparseGPTStart,
    StartWeights,
    SwapRefine,
)
from sparseswaps_prune.core.warmstart import importance_scores

FeatureStats = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


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


def start_stage(
    weight: torch.Tensor, gram: torch.Tensor, spec: PruneSpec, prior_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The start stage: ``[d_out, d_in]`` bool mask under ``spec.budget`` (True = kept), and the weights the start
    computed for it (``weight``'s dtype, zero off the mask) when ``spec.weights`` is
    :class:`~sparseswaps_prune.core.spec.StartWeights` or a guarded update (the guard's fallback), else None.

    With ``prior_mask`` (an already pruned tensor) every row prunes ``sparsity`` of its remaining weights by the
    start's scores, among the entries ``prior_mask`` keeps; ``weight`` must already be zero off it.
    """
    budget, start = spec.budget, spec.start
    want_weights = isinstance(spec.weights, StartWeights) or getattr(spec.weights, "guard", False)
    pattern = {"sparsity": budget.sparsity, "nm": budget.nm, "scope": budget.scope}
    if prior_mask is not None and not bool(prior_mask.all()):
        if budget.nm is not None or not isinstance(start, ScoreStart):
            raise ValueError(
                f"{'N:M' if budget.nm else start.name} pruning of an already pruned tensor is not supported; make "
                "the earlier pruning permanent (prune.remove), start from the dense weights, or prune it again with "
                "a score start per row or layer (e.g. the default spec, SPARSESWAPS_SPEC)"
            )
        scores = importance_scores(weight, start.score, gram).masked_fill(~prior_mask, float("-inf"))
        kept = prior_mask.sum(dim=1, keepdim=True)
        return keep_top(scores, kept - torch.round(budget.sparsity * kept).long()) & prior_mask, None
    if isinstance(start, ScoreStart):
        return select_mask(importance_scores(weight, start.score, gram), **pattern), None
    if isinstance(start, SparseGPTStart):
        out = sparsegpt_prune(
            weight, gram, **pattern, damp=start.damp, blocksize=start.blocksize, update_weights=want_weights
        )
    elif isinstance(start, ADMMStart):
        out = admm_prune(
            weight, gram, **pattern, iters=start.iters, reselect_iters=start.reselect_iters, rho=start.rho,
            damp=start.damp,
        )  # fmt: skip
    else:
        out = alps_prune(
            weight, gram, **pattern, rho=start.rho, max_iter=start.max_iter, update_iter=start.update_iter,
            switch_iter=start.switch_iter, cg_iters=start.cg_iters, cg_rtol=start.cg_rtol, damp=start.damp,
        )  # fmt: skip
    return out.keep_mask, out.weight if want_weights else None


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
        spec: the stages (default :data:`~sparseswaps_prune.core.spec.SPARSESWAPS_SPEC`: Wanda, 25 exact 1-swap
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
        weight = torch.where(prior_mask, weight, 0.0)
    refine = spec.refine
    if isinstance(refine, DSnoTRefine) and feature_stats is None:
        raise ValueError(
            "refine=DSnoTRefine needs feature_stats=(mean, var, sq_mean) from GramAccumulator.feature_stats"
        )
    started = time.perf_counter()
    start, start_weight = start_stage(weight, gram, spec, prior_mask)
    mask, searched_weight = start, None
    n_swaps, iters = torch.zeros(weight.shape[0], dtype=torch.long), 0
    if isinstance(refine, SwapRefine):
        fit = {"damp": spec.weights.damp, "ridge": spec.weights.ridge} if refine.objective == "refit" else {}
        refined = refine_mask(
            weight, gram, start, max_iters=refine.max_iters, nm=budget.nm, eps=refine.eps, device=device,
            dtype=getattr(torch, refine.search_dtype), backend=refine.backend, resync_every=refine.resync_every,
            objective=refine.objective, scope=refine.scope or budget.scope, **fit,
        )  # fmt: skip
        mask, n_swaps, iters, searched_weight = refined.mask, refined.n_swaps, refined.iters, refined.weight
        loss_start, loss_refined = refined.loss_before, refined.loss_after
    else:
        if isinstance(refine, DSnoTRefine) and not (refine.skip and name and f".{refine.skip}." in name):
            mean, var, sq_mean = feature_stats
            dsnot = dsnot_refine(
                weight, start, feature_mean=mean, feature_var=var, feature_sq_mean=sq_mean, nm=budget.nm,
                max_cycles=refine.max_cycles, update_threshold=refine.update_threshold,
            )  # fmt: skip
            mask, n_swaps, iters = dsnot.mask, dsnot.n_updates, dsnot.n_cycles
        loss_start = row_losses(weight, gram, start)
        loss_refined = loss_start if mask is start else row_losses(weight, gram, mask)
    if prior_mask is not None:
        mask = mask & prior_mask
    seconds_mask = time.perf_counter() - started

    published = isinstance(spec.weights, StartWeights)
    final = _final_weights(weight, gram, mask, spec, start_weight if published else searched_weight, device)
    _check_finite_weights(weight, gram, spec, start_weight, searched_weight, final)  # before anything is written
    holdout, row_updated = None, None if final is None else torch.ones(weight.shape[0], dtype=torch.bool)
    if holdout_gram is not None:
        held_refined = row_losses(weight, holdout_gram, mask)
        held_final = held_refined
        if final is not None:
            held_final = weight_losses(weight, final, holdout_gram)
            if spec.weights.guard:
                # a row rejecting the update keeps the start's weights where its mask is still the start's (ADMM,
                # ALPS, SparseGPT compensate), else its original weights on the mask
                fallback, held_fallback = torch.where(mask, weight, 0.0), held_refined
                if start_weight is not None and not published:
                    unchanged = (mask == start).all(dim=1)
                    fallback[unchanged] = start_weight[unchanged].to(fallback.dtype)
                    held_fallback = weight_losses(weight, fallback, holdout_gram)
                better = held_final < held_fallback
                final = torch.where(better[:, None], final, fallback)
                held_final = torch.where(better, held_final, held_fallback)
                row_updated = better.cpu()
        holdout = StageLosses(
            start=row_losses(weight, holdout_gram, start).cpu(), refined=held_refined.cpu(), final=held_final.cpu()
        )
    loss_final = loss_refined if final is None else weight_losses(weight, final, gram)
    return LayerOutcome(
        keep_mask=mask,
        start_mask=start,
        weight=final,
        loss=StageLosses(start=loss_start.cpu(), refined=loss_refined.cpu(), final=loss_final.cpu()),
        holdout=holdout,
        n_swaps=n_swaps.cpu(),
        iters=iters,
        updated_rows=None if row_updated is None else _mean(row_updated),
        seconds_mask=seconds_mask,
        seconds_weights=time.perf_counter() - started - seconds_mask,
        row_updated=row_updated,
    )


def _final_weights(
    weight: torch.Tensor,
    gram: torch.Tensor,
    mask: torch.Tensor,
    spec: PruneSpec,
    computed: torch.Tensor | None,
    device: torch.device | str | None,
) -> torch.Tensor | None:
    """The weight stage (before the held-out guard): ``[d_out, d_in]`` in ``weight``'s dtype and device, or None
    when the weights are kept. ``computed``: weights an earlier stage already computed for ``mask`` (the start's,
    or the re-fit objective's exact re-fit)."""
    stage = spec.weights
    if isinstance(stage, StartWeights) or (isinstance(stage, LeastSquares) and computed is not None):
        return computed.to(device=weight.device, dtype=weight.dtype)
    compute = weight.device if device is None else torch.device(device)
    w, keep = weight.to(compute), mask.to(compute)
    if isinstance(stage, LeastSquares):
        fitted = refit_weights(w, gram.to(compute), keep, damp=stage.damp, ridge=stage.ridge, solver=stage.solver)
    elif isinstance(stage, OBSUpdate):
        fitted = sparsegpt_prune(w, gram, keep_mask=keep, damp=stage.damp).weight
    elif isinstance(stage, ADMMUpdate):
        fitted = admm_update(w, gram.to(compute), keep, iters=stage.iters, rho=stage.rho, damp=stage.damp)
    elif isinstance(stage, ALPSUpdate):
        fitted = alps_update(
            w, gram.to(compute), keep, admm_iters=stage.admm_iters, rho=stage.rho, cg_iters=stage.cg_iters,
            cg_rtol=stage.cg_rtol, damp=stage.damp,
        )  # fmt: skip
    else:
        return None
    return fitted.to(weight.device)


# Above this |W| * sqrt(max diag G) the products a weight stage forms may overflow (float32 holds 3.4e38); a trained
# model's layers stay far below it.
HUGE_SCALE = 1e15


def _check_finite_weights(
    weight: torch.Tensor,
    gram: torch.Tensor,
    spec: PruneSpec,
    start: torch.Tensor | None,
    searched: torch.Tensor | None,
    final: torch.Tensor | None,
) -> None:
    """Raise ``ValueError`` naming the stage, the rows and the likely cause when a stage's weights (the start's, the
    refinement's re-fit, the weight stage's) are not all finite, so that a NaN is never written into a model."""
    stages = ("start", "refine", "weight"), (spec.start, spec.refine, spec.weights), (start, searched, final)
    for stage, kind, tensor in zip(*stages, strict=True):
        method = kind.name
        if tensor is None:
            continue
        bad = ~torch.isfinite(tensor).all(dim=1)
        if not bool(bad.any()):
            continue
        rows = torch.nonzero(bad).flatten().tolist()
        peak, diag = float(weight.abs().max()), float(torch.diagonal(gram).max())
        cause = (
            f"weights of magnitude up to {peak:.3g} overflow its arithmetic; rescale or clip them"
            if peak * max(diag, 0.0) ** 0.5 > HUGE_SCALE
            else f"{method} broke down numerically (largest weight {peak:.3g}, largest Gram diagonal {diag:.3g}); "
            "check the calibration inputs, or raise the stage's damp"
        )
        raise ValueError(
            f"the {stage} stage ({method}) returned non-finite weights in {len(rows)} of {weight.shape[0]} rows "
            f"(rows {rows[:5]}{', ...' if len(rows) > 5 else ''}): {cause}"
        )
