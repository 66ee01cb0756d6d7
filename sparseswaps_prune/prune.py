"""``torch.nn.utils.prune`` integration: :class:`SparseSwapsMethod` and :func:`sparseswaps_unstructured`.

Masks are the standard reparametrization (``weight_orig`` parameter, ``weight_mask`` buffer, a forward
pre-hook); ``prune.remove`` makes them permanent. Every layer is pruned row by row (warmstart, then
1-swap refinement against its Gram matrix), never by one global threshold, even when called through
``prune.global_unstructured``, which flattens all parameters into one vector.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.utils import prune

from sparseswaps_prune.core.checks import check_budget, check_gram, check_weight
from sparseswaps_prune.core.refit import REFIT_DAMP, refit_weights
from sparseswaps_prune.core.swaps import RefineResult, refine_mask
from sparseswaps_prune.core.warmstart import WARMSTARTS, importance_scores, keep_top, warmstart_mask


class SparseSwapsMethod(prune.BasePruningMethod):
    """Warmstart + SparseSwaps refinement as a ``torch.nn.utils.prune`` method.

    Args:
        amount: fraction of each row's currently unpruned weights to prune, in ``[0, 1)``; exclusive
            with ``nm``.
        grams: one ``[d_in, d_in]`` Gram matrix per pruned tensor, in parameter order.
        tensors: the ``(module, name)`` pairs being pruned, in the same order (as given to
            ``global_unstructured``). Gives each layer its 2-D shape and existing mask; required when a
            tensor is already pruned. Without it, ``shapes`` (or a single 2-D tensor) gives the shapes.
        shapes: ``(d_out, d_in)`` per tensor, when ``tensors`` is not given.
        warmstart: ``"magnitude"``, ``"wanda"``, ``"ria"`` or ``"sparsegpt"`` (SparseGPT's mask, weights kept).
        nm: ``(n, m)`` semi-structured pattern instead of ``amount``.
        max_iters: 1-swap iterations ``T_max`` (0: warmstart only).
        scope: budget, ``"row"`` or ``"layer"`` (the warmstart selects per layer and refinement also moves
            weights between rows, keeping the layer's count).
        refit: ``"none"`` or ``"ls"``: re-fit each row's kept weights by exact least squares on its Gram
            (:func:`~sparseswaps_prune.refit_weights`, ridge ``damp``). The re-fitted weights are written
            into the pruned tensors (they land in ``<name>_orig``; the masked entries stay zero in
            ``<name>``), so ``refit`` needs ``tensors=``.
        damp: relative dampening of the re-fit (and of the re-fit objective).
        **refine_kwargs: passed to :func:`~sparseswaps_prune.refine_mask` (``objective``, ``eps``, ``device``,
            ``dtype``, ``backend``, ``row_batch``). ``objective="refit"`` needs ``refit="ls"``.

    After ``compute_mask``, ``self.results`` holds each tensor's :class:`RefineResult` (with ``weight``
    set to the re-fitted weights when ``refit="ls"``).

    Example:
        >>> params = [(model.fc1, "weight"), (model.fc2, "weight")]
        >>> prune.global_unstructured(params, pruning_method=SparseSwapsMethod, amount=0.6,
        ...                           tensors=params, grams=[g1, g2], warmstart="wanda")
    """

    PRUNING_TYPE = "unstructured"

    def __init__(
        self,
        amount: float | None = None,
        *,
        grams: Sequence[torch.Tensor],
        tensors: Sequence[tuple[nn.Module, str]] | None = None,
        shapes: Sequence[tuple[int, int]] | None = None,
        warmstart: str = "wanda",
        nm: tuple[int, int] | None = None,
        max_iters: int = 100,
        scope: str = "row",
        refit: str = "none",
        damp: float = REFIT_DAMP,
        **refine_kwargs,
    ) -> None:
        if warmstart not in WARMSTARTS:
            raise ValueError(f"unknown warmstart {warmstart!r}; choose one of {', '.join(WARMSTARTS)}")
        if refit not in ("none", "ls"):
            raise ValueError(f"refit must be 'none' or 'ls', got {refit!r}")
        if refine_kwargs.get("objective", "mask") == "refit" and refit == "none":
            raise ValueError("objective='refit' chooses masks for re-fitted weights: also pass refit='ls'")
        if refit != "none" and tensors is None:
            raise ValueError("refit='ls' writes the re-fitted weights into the pruned tensors: pass tensors=")
        if isinstance(grams, torch.Tensor):
            grams = [grams]
        self.amount, self.grams, self.warmstart, self.nm = amount, list(grams), warmstart, nm
        self.tensors = list(tensors) if tensors is not None else None
        self.shapes = [tuple(s) for s in shapes] if shapes is not None else None
        self.max_iters, self.scope, self.refine_kwargs = max_iters, scope, refine_kwargs
        self.refit, self.damp = refit, damp
        self.results: list[RefineResult] = []
        count = len(self.tensors or self.shapes or self.grams)
        if len(self.grams) != count:
            raise ValueError(f"got {len(self.grams)} Gram matrices for {count} tensors; give one per tensor")

    def compute_mask(self, t: torch.Tensor, default_mask: torch.Tensor) -> torch.Tensor:
        """Mask for ``t``: a 2-D weight, or the flattened (possibly already sliced) vector that
        ``global_unstructured`` / a ``PruningContainer`` passes. Returns a mask shaped like ``t``."""
        layers = self._layers(t, default_mask)
        new_masks = [
            self.layer_mask(weight, existing, gram, name)
            for (name, weight, existing), gram in zip(layers, self.grams, strict=True)
        ]
        if self.refit != "none":
            self._write_refit(self.results[-len(layers) :])
        if t.dim() == 2:
            return new_masks[0].to(default_mask.dtype)
        full = torch.cat([m.reshape(-1) for m in new_masks])
        if t.numel() == full.numel():
            return full.to(default_mask.dtype)
        return full[torch.cat([e.reshape(-1) for _, _, e in layers])].to(default_mask.dtype)

    def _write_refit(self, results: list[RefineResult]) -> None:
        """Write each tensor's re-fitted weights into ``<name>_orig`` (or ``<name>`` if not yet pruned)."""
        with torch.no_grad():
            for (module, name), result in zip(self.tensors, results, strict=True):
                target = getattr(module, name + "_orig", None)
                target = getattr(module, name) if target is None else target
                target.copy_(result.weight.to(target.dtype))

    def _layers(self, t: torch.Tensor, default_mask: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(name, effective weight [d_out, d_in], existing bool mask)`` for every tensor."""
        if self.tensors is not None:
            layers = []
            for i, (module, name) in enumerate(self.tensors):
                weight = getattr(module, name).detach()
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

    def layer_mask(
        self, weight: torch.Tensor, existing: torch.Tensor, gram: torch.Tensor, name: str = "weight"
    ) -> torch.Tensor:
        """Bool mask ``[d_out, d_in]`` for one tensor: warmstart among the ``existing`` unpruned entries,
        then refinement; always a subset of ``existing``. Appends the refinement to ``self.results``."""
        try:
            check_weight(weight, what=f"{name} weight")
            check_gram(gram, weight.shape[1], what=f"{name} gram")
            check_budget(self.amount, self.nm, weight.shape[1])
        except (TypeError, ValueError) as err:
            raise type(err)(f"{name}: {err}") from None
        weight = torch.where(existing, weight, 0.0)
        if bool(existing.all()):
            keep = warmstart_mask(weight, self.warmstart, sparsity=self.amount, nm=self.nm, gram=gram, scope=self.scope)
        elif self.nm is not None or self.warmstart == "sparsegpt":
            raise ValueError(
                f"{name}: N:M or SparseGPT pruning of an already pruned tensor is not supported; prune.remove first"
            )
        else:
            scores = importance_scores(weight, self.warmstart, gram).masked_fill(~existing, float("-inf"))
            kept = existing.sum(dim=1, keepdim=True)
            keep = keep_top(scores, kept - torch.round(self.amount * kept).long()) & existing
        result = refine_mask(
            weight,
            gram,
            keep,
            max_iters=self.max_iters,
            nm=self.nm,
            scope=self.scope if self.nm is None else "row",
            damp=self.damp,
            **self.refine_kwargs,
        )
        result.mask &= existing
        if self.refit == "ls" and result.weight is None:
            try:
                result.weight = refit_weights(weight, gram, result.mask, damp=self.damp)
            except ValueError as err:
                raise ValueError(f"{name}: {err}") from None
        self.results.append(result)
        return result.mask


def sparseswaps_unstructured(
    module: nn.Module,
    name: str = "weight",
    amount: float | None = None,
    *,
    gram: torch.Tensor,
    warmstart: str = "wanda",
    max_iters: int = 100,
    nm: tuple[int, int] | None = None,
    **kwargs,
) -> nn.Module:
    """Prune ``module.<name>`` by warmstart + SparseSwaps, like ``prune.l1_unstructured``.

    Adds ``<name>_orig`` and ``<name>_mask`` to ``module`` (in place) and returns it. If the tensor is
    already pruned, the new mask prunes ``amount`` of each row's remaining weights and is combined with
    the existing one. On bad input (wrong Gram size, NaN, bad ``amount``/``nm``) raises before touching
    ``module``.

    Args:
        module: module holding a 2-D weight ``[d_out, d_in]`` (e.g. ``nn.Linear``).
        name: parameter name.
        amount: fraction of each row's unpruned weights to prune, in ``[0, 1)``; exclusive with ``nm``.
        gram: ``[d_in, d_in]`` Gram matrix of the module's inputs.
        warmstart, max_iters, nm, **kwargs: as :class:`SparseSwapsMethod` (``refit="ls"`` re-fits the kept
            weights; they land in ``<name>_orig``).

    Example:
        >>> sparseswaps_unstructured(layer, "weight", amount=0.6, gram=acc.gram, warmstart="wanda")
        >>> prune.remove(layer, "weight")
    """
    method = SparseSwapsMethod(
        amount, grams=[gram], tensors=[(module, name)], warmstart=warmstart, max_iters=max_iters, nm=nm, **kwargs
    )
    weight = getattr(module, name).detach()
    existing = getattr(module, name + "_mask", torch.ones_like(weight)).detach().bool()
    mask = method.layer_mask(weight, existing, gram, f"{type(module).__name__}.{name}")  # validates first
    prune.custom_from_mask(module, name, mask)
    if method.refit != "none":
        method._write_refit(method.results)
        setattr(module, name, getattr(module, name + "_orig") * getattr(module, name + "_mask"))
    return module
