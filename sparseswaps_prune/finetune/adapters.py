"""Sparsity-preserving low-rank adapters: MaskLoRA and ScaleLoRA (PERP, arXiv 2312.15230).

For a linear layer with ``[d_out, d_in]`` weight ``W`` (the effective, masked weight) and pruning mask ``M``,
an adapter of rank ``r`` holds ``A`` ``[r, d_in]`` and ``B`` ``[d_out, r]`` and changes the layer to

* MaskLoRA: ``W + s * (B A) * M``: a low-rank update restricted to the kept weights;
* ScaleLoRA: ``W * (1 + s * (B A))``: a multiplicative update, zero wherever ``W`` is zero;

with ``s = alpha / r``. ``B`` starts at zero, so attaching an adapter changes nothing until it is trained,
and :func:`merge_adapters` folds the update into the weight with exactly the zeros pruning left.

Where the adapters live. Pruning code (the pipeline, :class:`~sparseswaps_prune.callbacks.SparseSwapsPruning`)
finds every ``nn.Linear`` / ``Conv1D`` in a model, so an adapter must not be an ``nn.Linear`` submodule (it
would be pruned itself). Here ``A`` and ``B`` are parameters registered on the linear module itself
(``adapter_A``, ``adapter_B``) and the update is added to the layer output by a forward hook (an
:class:`AdapterHook`); the module keeps its class, name and ``weight``, and pruning it before or after the
adapter is attached works the same.

The mask ``M`` of a layer, read on every forward (so pruning after attaching is followed):

* the ``weight_mask`` buffer when the layer is pruned through ``torch.nn.utils.prune`` (``weight_orig``,
  ``weight_mask`` and a forward pre-hook);
* otherwise (never pruned, or pruning made permanent with ``prune.remove``) the nonzeros of the weight when
  the adapter was attached (the non-persistent buffer ``adapter_mask``), and-ed with the current nonzeros of
  the weight.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune

from sparseswaps_prune.modules import PrunableLayer, check_patterns, find_blocks, find_layers, is_transposed

logger = logging.getLogger(__name__)

__all__ = [
    "ADAPTER_KINDS",
    "AdapterHook",
    "adapted_modules",
    "adapter_delta",
    "adapter_mask",
    "attach_adapters",
    "effective_weight",
    "merge_adapters",
    "select_layers",
]

ADAPTER_KINDS = ("masklora", "scalelora")
"""Adapter kinds :func:`attach_adapters` accepts."""

_HOOK_ATTR = "_sparse_adapter"
"""Attribute of an adapted module that holds its :class:`AdapterHook`."""


class AdapterHook:
    """The forward hook of one adapted layer, and the adapter's settings.

    Called as a forward hook with kwargs: adds ``x @ delta.T`` to the layer output ``[..., d_out]``, where
    ``delta = adapter_delta(module)`` ``[d_out, d_in]``. A module-level class (not a closure) so that models
    with adapters can be pickled (``ddp_spawn``), deep-copied and saved whole.

    Attributes:
        kind: ``"masklora"`` or ``"scalelora"``.
        rank: the rank ``r``.
        scale: ``s = alpha / r``.
        handle: the ``RemovableHandle`` of the hook (used by :func:`merge_adapters`).
    """

    def __init__(self, kind: str, rank: int, scale: float) -> None:
        self.kind, self.rank, self.scale = kind, rank, scale
        self.handle: Any = None

    def __call__(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        x = args[0] if args else next(iter(kwargs.values()))
        delta = adapter_delta(module)
        return output + F.linear(x, delta.to(dtype=x.dtype))

    def __repr__(self) -> str:
        return f"AdapterHook(kind={self.kind!r}, rank={self.rank}, scale={self.scale})"


def _hook(module: nn.Module) -> AdapterHook | None:
    hook = getattr(module, _HOOK_ATTR, None)
    return hook if isinstance(hook, AdapterHook) else None


def _is_reparametrized(module: nn.Module) -> bool:
    """Pruned through ``torch.nn.utils.prune`` (``weight_orig`` parameter and ``weight_mask`` buffer)."""
    return prune.is_pruned(module) and hasattr(module, "weight_mask") and hasattr(module, "weight_orig")


def _current_weight(module: nn.Module) -> torch.Tensor:
    """The masked weight in the parameter layout, recomputed (``module.weight`` of a pruned layer is only
    refreshed by its forward pre-hook)."""
    return module.weight_orig * module.weight_mask if _is_reparametrized(module) else module.weight


def adapter_mask(module: nn.Module) -> torch.Tensor:
    """The mask an adapted layer's update is restricted to, in the weight's own layout (bool, True = kept).

    ``weight_mask`` while the layer is pruned through ``torch.nn.utils.prune``; otherwise the nonzeros of the
    weight recorded when the adapter was attached, and-ed with the current nonzeros of ``module.weight``.

    Args:
        module: an ``nn.Linear`` / ``Conv1D`` with an adapter (see :func:`attach_adapters`); not modified.

    Returns:
        A bool tensor shaped like ``module.weight`` (``[d_out, d_in]``, or ``[d_in, d_out]`` for ``Conv1D``).

    Raises:
        ValueError: the module has no adapter.
    """
    if _hook(module) is None:
        raise ValueError(f"{type(module).__name__} has no adapter; attach one with attach_adapters(model)")
    if _is_reparametrized(module):
        return module.weight_mask.bool()
    return module.adapter_mask & (module.weight != 0)


def adapter_delta(module: nn.Module) -> torch.Tensor:
    """The adapter's additive change of the weight, ``[d_out, d_in]`` (the layout ``y = x @ delta.T``).

    MaskLoRA: ``s * (B @ A) * M``; ScaleLoRA: ``s * W * (B @ A)`` with ``W`` the current effective weight
    (``module.weight``, masked when pruned). Zero wherever the mask (:func:`adapter_mask`) or ``W`` is zero.
    Differentiable in ``adapter_A`` and ``adapter_B`` (and in ``W`` for ScaleLoRA if it requires grad).

    Args:
        module: an ``nn.Linear`` / ``Conv1D`` with an adapter; not modified.

    Returns:
        A ``[d_out, d_in]`` tensor in the adapter's dtype.

    Raises:
        ValueError: the module has no adapter.
    """
    hook = _hook(module)
    if hook is None:
        raise ValueError(f"{type(module).__name__} has no adapter; attach one with attach_adapters(model)")
    update = module.adapter_B @ module.adapter_A  # [d_out, d_in]
    transposed = is_transposed(module)
    if hook.kind == "masklora":
        mask = adapter_mask(module)
        mask = mask.t() if transposed else mask
        return hook.scale * update * mask.to(update.dtype)
    weight = _current_weight(module)
    weight = weight.t() if transposed else weight
    return hook.scale * weight.to(update.dtype) * update


def effective_weight(module: nn.Module) -> torch.Tensor:
    """The ``[d_out, d_in]`` weight a linear layer computes with now: ``module.weight`` (masked when pruned
    through ``torch.nn.utils.prune``) plus the adapter's update when it has one.

    Args:
        module: an ``nn.Linear`` or ``Conv1D``; not modified.

    Returns:
        A detached ``[d_out, d_in]`` tensor (may share storage with the weight: copy it before writing).
    """
    with torch.no_grad():
        weight = _current_weight(module)
        weight = weight.t() if is_transposed(module) else weight
        if _hook(module) is not None:
            weight = weight + adapter_delta(module).to(weight.dtype)
        return weight.detach()


def adapted_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every layer of ``model`` with an adapter, in module order."""
    return [(name, m) for name, m in model.named_modules() if _hook(m) is not None]


def select_layers(
    model: nn.Module,
    *,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    blocks_path: str | None = None,
) -> list[PrunableLayer]:
    """The linear layers that adapters (or peft LoRA) go on: by default the layers pruning selects.

    Args:
        model: the model (a Hugging Face causal LM, or any module holding one); not modified.
        include: fnmatch patterns on qualified names (as in ``model.named_modules()``); given, every
            ``nn.Linear`` / ``Conv1D`` of ``model`` matching one of them is selected. ``None``: every
            ``nn.Linear`` / ``Conv1D`` inside the decoder blocks (``lm_head`` and embeddings are outside the
            blocks), as the pruning pipeline selects them.
        exclude: fnmatch patterns; matching layers are dropped.
        blocks_path: dotted path of the decoder-block ``ModuleList`` (default: found structurally, see
            :func:`~sparseswaps_prune.modules.find_blocks`); only used when ``include`` is ``None``.

    Returns:
        The layers in module order.

    Raises:
        TypeError: ``include`` / ``exclude`` is a single string.
        ValueError: nothing is selected, or ``include`` is ``None`` and ``model`` has no decoder blocks.
    """
    include = check_patterns(include, "include")
    exclude = check_patterns(exclude, "exclude")
    if include is not None:
        layers = find_layers(model, prefix="", include=include, exclude=exclude)
    else:
        path, blocks = find_blocks(model, blocks_path)
        layers = [
            layer
            for i, block in enumerate(blocks)
            for layer in find_layers(block, prefix=f"{path}.{i}", exclude=exclude)
        ]
    if not layers:
        raise ValueError(
            f"no nn.Linear/Conv1D of {type(model).__name__} matches include={include} exclude={exclude}; check "
            "the patterns against model.named_modules()"
        )
    return layers


def _check_rank_alpha(rank: int, alpha: float | None) -> float:
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int, got {rank!r}")
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    if alpha is None:
        return 1.0
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise TypeError(f"alpha must be a finite number or None (= rank, scale 1), got {alpha!r}")
    return float(alpha) / rank


def attach_adapters(
    model: nn.Module,
    kind: str = "masklora",
    *,
    rank: int = 8,
    alpha: float | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    blocks_path: str | None = None,
    seed: int = 0,
) -> list[str]:
    """Attach a zero-initialised MaskLoRA or ScaleLoRA adapter to every selected linear layer, in place.

    Each selected ``nn.Linear`` / ``Conv1D`` (weight ``[d_out, d_in]`` / ``[d_in, d_out]``) gets parameters
    ``adapter_A`` ``[rank, d_in]`` (Kaiming-uniform, as ``nn.Linear``, from a generator seeded with ``seed``)
    and ``adapter_B`` ``[d_out, rank]`` (zeros), in the weight's dtype and device, a non-persistent bool buffer
    ``adapter_mask`` (the weight's current nonzeros) and a forward hook. No submodule is added, so pruning code
    that looks for ``nn.Linear`` finds the same layers as before. Since ``B = 0`` the model computes exactly
    the same outputs until the adapters are trained. The layer may be dense, pruned through
    ``torch.nn.utils.prune``, or pruned permanently; see the module docstring for the mask that is used.

    Attach before building the optimizer (before ``Trainer.fit``): the adapter parameters then exist when
    ``configure_optimizers`` and DDP see the model, also when a callback prunes at fit start.

    Args:
        model: the model; modified in place. Other parameters keep their ``requires_grad`` (see
            :func:`~sparseswaps_prune.finetune.perp.mark_trainable` to freeze them).
        kind: ``"masklora"`` (``W + s * (B A) * M``) or ``"scalelora"`` (``W * (1 + s * (B A))``).
        rank: the rank ``r`` (>= 1).
        alpha: the scale is ``s = alpha / rank``; ``None`` means ``alpha = rank`` (``s = 1``).
        include, exclude, blocks_path: which layers, see :func:`select_layers` (default: every linear in the
            decoder blocks).
        seed: seed of the initialisation of ``A`` (the same on every DDP rank).

    Returns:
        The qualified names of the adapted layers.

    Raises:
        ValueError: unknown ``kind``, ``rank`` < 1, no layer selected, or a selected layer already has an
            adapter.
        TypeError: ``rank`` / ``alpha`` / patterns of the wrong type.

    Example:
        >>> names = attach_adapters(model, "masklora", rank=8)   # after (or before) pruning
        >>> # ... train adapter_A / adapter_B (and biases, norms) ...
        >>> merge_adapters(model)                                # zeros exactly where pruning left them
    """
    if kind not in ADAPTER_KINDS:
        raise ValueError(f"unknown adapter kind {kind!r}; choose one of {', '.join(ADAPTER_KINDS)}")
    scale = _check_rank_alpha(rank, alpha)
    layers = select_layers(model, include=include, exclude=exclude, blocks_path=blocks_path)
    already = [layer.name for layer in layers if _hook(layer.module) is not None]
    if already:
        raise ValueError(f"layers {already[:3]} already have an adapter; call merge_adapters(model) first")
    generator = torch.Generator().manual_seed(seed)
    for layer in layers:
        module = layer.module
        weight = module.weight
        a = torch.empty(rank, layer.d_in, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        module.register_parameter("adapter_A", nn.Parameter(a.to(device=weight.device, dtype=weight.dtype)))
        module.register_parameter(
            "adapter_B", nn.Parameter(torch.zeros(layer.d_out, rank, device=weight.device, dtype=weight.dtype))
        )
        module.register_buffer("adapter_mask", weight.detach() != 0, persistent=False)
        hook = AdapterHook(kind, rank, scale)
        hook.handle = module.register_forward_hook(hook, with_kwargs=True)
        setattr(module, _HOOK_ATTR, hook)
    logger.info("attached %s adapters (rank %d, scale %g) to %d layers", kind, rank, scale, len(layers))
    return [layer.name for layer in layers]


@torch.no_grad()
def merge_adapters(model: nn.Module) -> list[str]:
    """Fold every adapter of ``model`` into its layer's weight and remove the adapter, in place.

    For each adapted layer the update :func:`adapter_delta` (zero outside the mask) is added to the dense
    weight (``weight_orig`` while the layer is pruned through ``torch.nn.utils.prune``, which stays pruned;
    else ``weight``, whose entries outside the mask are then set to exactly zero), and ``adapter_A``,
    ``adapter_B``, ``adapter_mask`` and the forward hook are removed. The layer computes the same outputs as
    before (up to rounding), and its zeros are exactly those pruning left. The weight ``Parameter`` objects
    stay the same (optimizers holding them stay valid).

    Args:
        model: the model; modified in place.

    Returns:
        The qualified names of the merged layers (empty when there were no adapters).
    """
    merged = []
    for name, module in adapted_modules(model):
        hook = _hook(module)
        mask = adapter_mask(module)
        delta = adapter_delta(module)
        delta = delta.t() if is_transposed(module) else delta
        if _is_reparametrized(module):
            module.weight_orig.add_(delta.to(module.weight_orig.dtype))
            module.weight = module.weight_orig * module.weight_mask
        else:
            module.weight.add_(delta.to(module.weight.dtype)).masked_fill_(~mask, 0.0)
        hook.handle.remove()
        delattr(module, _HOOK_ATTR)
        del module.adapter_A, module.adapter_B, module.adapter_mask
        merged.append(name)
    if merged:
        logger.info("merged %d adapters into their weights", len(merged))
    return merged
