"""``torch.nn.utils.prune`` integration: :class:`SparseSwapsMethod` and :func:`sparseswaps_unstructured`.

By default a method here computes masks only, as ``torch.nn.utils.prune`` methods do: ADMM's mask as the warmstart
(its weights discarded), then exact, loss-decreasing 1-swaps against each layer's Gram matrix
(:data:`~sparseswaps_prune.core.spec.SPARSESWAPS_SPEC`).
Masks are the standard reparametrization (``weight_orig`` is the original parameter, untouched; ``weight_mask`` a
buffer; a forward pre-hook); ``prune.remove`` makes ``weight_orig * weight_mask`` permanent. Every layer is pruned
row by row, never by one global threshold, even when called through ``prune.global_unstructured``, which flattens
all parameters into one vector.

A weight update is something the user asks for (``weights="ls"``, or a recipe whose layer spec updates weights,
e.g. ``recipe="alps"``): it lands in ``weight_orig``, so ``prune.remove`` gives the updated, pruned weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.utils import prune

from sparseswaps_prune.core.checks import check_budget, check_gram, check_weight
from sparseswaps_prune.core.layer import FeatureStats, LayerOutcome, prune_layer
from sparseswaps_prune.core.spec import DSnoTRefine, PruneSpec, build_spec
from sparseswaps_prune.recipes import layer_spec


class SparseSwapsMethod(prune.BasePruningMethod):
    """SparseSwaps as a ``torch.nn.utils.prune`` method: computes each tensor's mask by a warmstart plus exact 1-swap
    refinement (:func:`~sparseswaps_prune.core.layer.prune_layer` with
    :data:`~sparseswaps_prune.core.spec.SPARSESWAPS_SPEC`: ADMM's mask, 25 swap iterations per row; masks only, so
    ``weight_orig`` stays the original parameter). Any other spec or recipe runs the same way.

    Args:
        amount: fraction of each row's (or, with ``scope="layer"``, each layer's) currently unpruned weights to
            prune, in ``[0, 1)`` (the spec's ``sparsity``); exclusive with ``nm``. Pruning an already pruned tensor
            again needs an ADMM or score start (the default's ADMM is one), not N:M.
        grams: one ``[d_in, d_in]`` Gram matrix per pruned tensor, in parameter order.
        tensors: the ``(module, name)`` pairs being pruned, in the same order (as given to
            ``global_unstructured``). Gives each layer its 2-D shape and existing mask, and is where updated
            weights are written when the spec updates weights (they land in ``<name>_orig``; the masked entries
            stay zero in ``<name>``); required when a tensor is already pruned or the spec updates weights.
            Without it, ``shapes`` (or a single 2-D tensor) gives the shapes.
        shapes: ``(d_out, d_in)`` per tensor, when ``tensors`` is not given.
        feature_stats: one ``(mean, var, sq_mean)`` ``[d_in]`` input-statistics triple per tensor
            (``GramAccumulator(track_sum=True).feature_stats(n_samples=...)``); needed by ``refine="dsnot"``
            only.
        spec: the per-layer :class:`~sparseswaps_prune.core.spec.PruneSpec` (default
            :data:`~sparseswaps_prune.core.spec.SPARSESWAPS_SPEC`); exclusive with ``recipe``.
        recipe: a name in :data:`~sparseswaps_prune.recipes.RECIPES`: its layer spec (e.g. ``"alps"``: ALPS's mask
            and weights; block tuning is the pipeline's and does not run here).
        **options: flat options changing the spec (:func:`~sparseswaps_prune.core.spec.build_spec`): ``nm``,
            ``scope``, ``start``, ``refine``, ``max_iters``, ``eps``, ``objective``, ``search_dtype``, ``backend``,
            ``weights`` (e.g. ``"ls"``: a least-squares re-fit, written into ``<name>_orig``), ``damp``, ``guard``,
            ``ridge``, ``start_damp``; ``warmstart`` (now ``start``) is accepted with a ``DeprecationWarning``.

    After ``compute_mask``, ``self.results`` holds each tensor's
    :class:`~sparseswaps_prune.core.layer.LayerOutcome` (masks, weights, every stage's per-row loss).

    Example:
        >>> params = [(model.fc1, "weight"), (model.fc2, "weight")]
        >>> prune.global_unstructured(params, pruning_method=SparseSwapsMethod, amount=0.6,
        ...                           tensors=params, grams=[g1, g2], max_iters=50)  # ADMM + 50 swap iterations
        >>> prune.global_unstructured(params, pruning_method=SparseSwapsMethod, amount=0.6, tensors=params,
        ...                           grams=[g1, g2], recipe="alps")  # ALPS's masks, its weights in weight_orig
    """

    PRUNING_TYPE = "unstructured"

    def __init__(
        self,
        amount: float | None = None,
        *,
        grams: Sequence[torch.Tensor],
        tensors: Sequence[tuple[nn.Module, str]] | None = None,
        shapes: Sequence[tuple[int, int]] | None = None,
        feature_stats: Sequence[FeatureStats] | None = None,
        spec: PruneSpec | None = None,
        recipe: str | None = None,
        **options,
    ) -> None:
        if amount is not None and options.get("nm") is not None:
            raise ValueError("give amount= (e.g. 0.6) or nm= (e.g. (2, 4)), not both")
        self.spec = build_spec(layer_spec(spec, recipe), sparsity=amount, **options)
        if self.spec.updates_weights and tensors is None:
            raise ValueError(
                f"weights={self.spec.weights.name!r} writes updated weights into the pruned tensors: pass "
                "tensors=<the (module, name) list>, or weights='keep' to keep them"
            )
        if isinstance(grams, torch.Tensor):
            grams = [grams]
        self.grams = list(grams)
        self.tensors = list(tensors) if tensors is not None else None
        for i, (module, name) in enumerate(self.tensors or []):
            if isinstance(module, nn.Embedding):
                raise TypeError(
                    f"tensors[{i}] (Embedding.{name}): SparseSwaps prunes linear layers (y = W x, judged on the Gram "
                    "of x); an embedding table has no input Gram: leave it out of the parameters to prune"
                )
        self.shapes = [tuple(s) for s in shapes] if shapes is not None else None
        self.results: list[LayerOutcome] = []
        count = len(self.tensors or self.shapes or self.grams)
        if len(self.grams) != count:
            raise ValueError(f"got {len(self.grams)} Gram matrices for {count} tensors; give one per tensor")
        if isinstance(self.spec.refine, DSnoTRefine) and feature_stats is None:
            raise ValueError(
                "refine='dsnot' needs each layer's input means, which a Gram lacks: pass feature_stats=[(mean, var, "
                "sq_mean) per tensor] from GramAccumulator(d_in, track_sum=True).feature_stats()"
            )
        self.feature_stats = list(feature_stats) if feature_stats is not None else [None] * count
        if len(self.feature_stats) != count:
            raise ValueError(f"got {len(self.feature_stats)} feature_stats for {count} tensors; give one per tensor")

    def compute_mask(self, t: torch.Tensor, default_mask: torch.Tensor) -> torch.Tensor:
        """Mask for ``t``: a 2-D weight, or the flattened (possibly already sliced) vector that
        ``global_unstructured`` / a ``PruningContainer`` passes. Returns a mask shaped like ``t``.

        Every layer is checked before any is pruned, and updated weights are written only after every layer's
        outcome is known, so an error leaves the tensors as they were."""
        layers = self._layers(t, default_mask)
        for (name, weight, _), gram in zip(layers, self.grams, strict=True):
            self._check(weight, gram, name)
        outcomes = [
            self.layer_outcome(weight, existing, gram, name, stats)
            for (name, weight, existing), gram, stats in zip(layers, self.grams, self.feature_stats, strict=True)
        ]
        if self.spec.updates_weights:
            self._write_weights(outcomes)
        new_masks = [outcome.keep_mask for outcome in outcomes]
        if t.dim() == 2:
            return new_masks[0].to(default_mask.dtype)
        full = torch.cat([m.reshape(-1) for m in new_masks])
        if t.numel() == full.numel():
            return full.to(default_mask.dtype)
        return full[torch.cat([e.reshape(-1) for _, _, e in layers])].to(default_mask.dtype)

    def _write_weights(self, outcomes: list[LayerOutcome]) -> None:
        """Write each tensor's final weights into ``<name>_orig`` (or ``<name>`` if not yet pruned)."""
        with torch.no_grad():
            for (module, name), outcome in zip(self.tensors, outcomes, strict=True):
                target = getattr(module, name + "_orig", None)
                target = getattr(module, name) if target is None else target
                target.copy_(outcome.weight.to(target.dtype))

    def _layers(self, t: torch.Tensor, default_mask: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(name, effective weight [d_out, d_in], existing bool mask)`` for every tensor."""
        if self.tensors is not None:
            layers = []
            for i, (module, name) in enumerate(self.tensors):
                weight = getattr(module, name, None)
                if weight is None:  # inside BasePruningMethod.apply on a dense tensor: torch moved it to _orig
                    weight = getattr(module, name + "_orig")
                weight = weight.detach()
                existing = getattr(module, name + "_mask", torch.ones_like(weight)).detach().bool()
                layers.append((f"tensors[{i}] ({type(module).__name__}.{name})", weight, existing))
            total = sum(int(e.sum()) for _, _, e in layers)
            if t.numel() not in (total, sum(w.numel() for _, w, _ in layers)):
                raise ValueError(
                    f"the tensor being pruned has {t.numel()} entries but tensors= describe {total} "
                    "unpruned ones; pass the same (module, name) pairs, in the same order, as to the pruning call"
                )
            return layers
        if t.dim() == 2:
            return [("weight", t.detach(), default_mask.detach().bool())]
        if self.shapes is None:
            raise ValueError(
                "SparseSwapsMethod needs each tensor's 2-D shape when called on a flattened vector: pass "
                "tensors=<the same (module, name) list> or shapes=[(d_out, d_in), ...]"
            )
        sizes = [d_out * d_in for d_out, d_in in self.shapes]
        if t.numel() != sum(sizes):
            raise ValueError(
                f"got {t.numel()} entries for shapes totalling {sum(sizes)}; some tensors are already pruned, "
                "so pass tensors=<the (module, name) list> so the method sees their 2-D masks"
            )
        chunks = zip(t.detach().split(sizes), default_mask.detach().bool().split(sizes), self.shapes, strict=True)
        return [(f"tensor[{i}]", w.reshape(s), m.reshape(s)) for i, (w, m, s) in enumerate(chunks)]

    def _check(self, weight: torch.Tensor, gram: torch.Tensor, name: str) -> None:
        """Raise (naming the tensor) if ``weight``/``gram`` cannot be pruned under the spec's budget."""
        try:
            check_weight(weight, what="weight")
            check_gram(gram, weight.shape[1])
            check_budget(self.spec.budget.sparsity, self.spec.budget.nm, weight.shape[1])
        except (TypeError, ValueError) as err:
            raise type(err)(f"{name}: {err}") from None

    def layer_outcome(
        self,
        weight: torch.Tensor,
        existing: torch.Tensor,
        gram: torch.Tensor,
        name: str = "weight",
        feature_stats: FeatureStats | None = None,
    ) -> LayerOutcome:
        """Prune one tensor (``[d_out, d_in]``) with ``prune_layer``: the new mask prunes ``amount`` of each
        row's ``existing`` unpruned entries and is a subset of them. Appends the outcome to ``self.results``."""
        self._check(weight, gram, name)
        prior = None if bool(existing.all()) else existing
        outcome = prune_layer(weight, gram, self.spec, prior_mask=prior, feature_stats=feature_stats, name=name)
        self.results.append(outcome)
        return outcome


def sparseswaps_unstructured(
    module: nn.Module,
    name: str = "weight",
    amount: float | None = None,
    *,
    gram: torch.Tensor,
    feature_stats: FeatureStats | None = None,
    spec: PruneSpec | None = None,
    recipe: str | None = None,
    **options,
) -> nn.Module:
    """Prune ``module.<name>`` with SparseSwaps, like ``prune.l1_unstructured``: ADMM's mask refined by exact
    1-swaps against ``gram`` (:data:`~sparseswaps_prune.core.spec.SPARSESWAPS_SPEC`), masks only.

    Adds ``<name>_orig`` (the original parameter) and ``<name>_mask`` to ``module`` (in place) and returns it; a
    weight update, if asked for (``weights=``, a spec or recipe that updates weights), lands in ``<name>_orig``. If
    the tensor is already pruned, the new mask prunes ``amount`` of each row's remaining weights and is combined
    with the existing one (ADMM and score starts; not N:M). On bad input (wrong Gram size, NaN, bad
    ``amount``/``nm``/option) raises before touching ``module``.

    Args:
        module: module holding a 2-D weight ``[d_out, d_in]`` (e.g. ``nn.Linear``).
        name: parameter name.
        amount: fraction of each row's (with ``scope="layer"``, the layer's) unpruned weights to prune, in
            ``[0, 1)``; exclusive with ``nm``.
        gram: ``[d_in, d_in]`` Gram matrix of the module's inputs.
        feature_stats: ``(mean, var, sq_mean)`` of the module's inputs, for ``refine="dsnot"`` only.
        spec, recipe, **options: as :class:`SparseSwapsMethod` (e.g. ``nm=(2, 4)``, ``max_iters=100``,
            ``start="ria"`` or ``recipe="alps"``).

    Example:
        >>> sparseswaps_unstructured(layer, "weight", amount=0.6, gram=acc.gram)
        >>> prune.remove(layer, "weight")
    """
    stats = None if feature_stats is None else [feature_stats]
    method = SparseSwapsMethod(
        amount, grams=[gram], tensors=[(module, name)], feature_stats=stats, spec=spec, recipe=recipe, **options
    )
    weight = getattr(module, name).detach()
    existing = getattr(module, name + "_mask", torch.ones_like(weight)).detach().bool()
    outcome = method.layer_outcome(weight, existing, gram, f"{type(module).__name__}.{name}", feature_stats)
    prune.custom_from_mask(module, name, outcome.keep_mask)
    if outcome.weight is not None:
        method._write_weights([outcome])
        setattr(module, name, getattr(module, name + "_orig") * getattr(module, name + "_mask"))
    return module
