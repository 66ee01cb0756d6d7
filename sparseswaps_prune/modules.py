"""Prunable linear maps of any ``nn.Module``: discovery (of the linears, and of a model's decoder blocks), input hooks
and ``torch.nn.utils.prune`` masks.

Shared by :mod:`sparseswaps_prune.prune`, the Hugging Face pipeline (``llm/``), the Lightning callback
(``callbacks/``) and fine-tuning (``finetune/``). The prunable layers are every ``nn.Linear`` and every GPT-2
style ``transformers.pytorch_utils.Conv1D`` (weight stored ``[d_in, d_out]``). ``transformers`` is never
imported here: a model can only hold a ``Conv1D`` once ``transformers.pytorch_utils`` is loaded, so the class
is looked up in ``sys.modules`` when needed.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn
from torch.nn.utils import prune

logger = logging.getLogger(__name__)

__all__ = [
    "PrunableLayer",
    "apply_mask",
    "check_patterns",
    "find_blocks",
    "find_layers",
    "input_hooks",
    "is_transposed",
    "linear_types",
    "replace_weight_mask",
    "restore_masks",
    "same_param_slot",
]


def linear_types() -> tuple[type[nn.Module], ...]:
    """The module classes treated as linear maps: ``nn.Linear``, plus ``transformers.pytorch_utils.Conv1D``
    when transformers has loaded it (it is never imported here).

    Returns:
        ``(nn.Linear,)`` or ``(nn.Linear, Conv1D)``, for ``isinstance`` checks.
    """
    pytorch_utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(pytorch_utils, "Conv1D", None)
    return (nn.Linear,) if conv1d is None else (nn.Linear, conv1d)


def is_transposed(module: nn.Module) -> bool:
    """True when ``module`` is a transformers ``Conv1D``, whose weight is stored ``[d_in, d_out]``."""
    return isinstance(module, linear_types()[1:])


@dataclass(frozen=True)
class PrunableLayer:
    """One prunable linear map inside a model.

    Attributes:
        name: fully qualified module name, e.g. ``"model.layers.0.self_attn.q_proj"``.
        module: the ``nn.Linear`` (weight ``[d_out, d_in]``) or ``Conv1D`` (weight ``[d_in, d_out]``).
    """

    name: str
    module: nn.Module

    @property
    def is_transposed(self) -> bool:
        """True when the parameter is stored ``[d_in, d_out]`` (``Conv1D``)."""
        return is_transposed(self.module)

    @property
    def d_out(self) -> int:
        """Number of output features."""
        return self.module.weight.shape[1] if self.is_transposed else self.module.weight.shape[0]

    @property
    def d_in(self) -> int:
        """Number of input features (the size of the last axis of the layer input)."""
        return self.module.weight.shape[0] if self.is_transposed else self.module.weight.shape[1]

    def weight_2d(self) -> torch.Tensor:
        """The weight as a ``[d_out, d_in]`` view of the parameter data (same dtype and device).

        The layer computes ``y = x @ weight_2d().T + bias``. The result shares storage with the parameter, so
        in-place writes to it (e.g. ``weight_2d().mul_(mask)``) modify the layer; for ``Conv1D`` it is a
        non-contiguous transpose view.
        """
        return self._as_2d(self.module.weight.data)

    def dense_weight_2d(self) -> torch.Tensor:
        """Like :meth:`weight_2d`, but of the unmasked ``weight_orig`` when the layer is pruned through
        ``torch.nn.utils.prune`` (the dense or re-fitted weights), detached."""
        return self._as_2d(getattr(self.module, "weight_orig", self.module.weight).detach())

    def _as_2d(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.t() if self.is_transposed else weight

    def to_param_layout(self, mask_2d: torch.Tensor) -> torch.Tensor:
        """Map a ``[d_out, d_in]`` tensor (mask, scores, ...) to the parameter's own layout.

        Args:
            mask_2d: ``[d_out, d_in]`` tensor of any dtype; not modified.

        Returns:
            A tensor shaped like ``module.weight``: ``mask_2d`` itself for ``nn.Linear``, its transpose view
            ``[d_in, d_out]`` for ``Conv1D`` (shares storage with ``mask_2d``; call ``.contiguous()`` for a
            copy).

        Raises:
            ValueError: ``mask_2d`` is not shaped ``[d_out, d_in]``.
        """
        if tuple(mask_2d.shape) != (self.d_out, self.d_in):
            raise ValueError(
                f"mask for {self.name} has shape {tuple(mask_2d.shape)}; expected [d_out, d_in] = "
                f"[{self.d_out}, {self.d_in}] (the layout of weight_2d())"
            )
        return mask_2d.t() if self.is_transposed else mask_2d


def check_patterns(value: Sequence[str] | None, arg: str) -> list[str] | None:
    """Validate an include/exclude argument.

    Args:
        value: ``None`` or a sequence of fnmatch patterns.
        arg: the argument's name, for the error message.

    Returns:
        ``None`` or the patterns as a new list.

    Raises:
        TypeError: ``value`` is a single string or holds non-strings.
    """
    if value is None:
        return None
    if isinstance(value, str) or not all(isinstance(p, str) for p in value):
        raise TypeError(f"{arg}={value!r} must be a list of fnmatch patterns, e.g. {arg}=['*.q_proj']")
    return list(value)


def find_layers(
    block: nn.Module,
    *,
    prefix: str,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
) -> list[PrunableLayer]:
    """All ``nn.Linear`` and ``Conv1D`` modules of ``block``, in module order.

    Args:
        block: a decoder block or any module; not modified.
        prefix: the block's own fully qualified name (e.g. ``"model.layers.3"``), prepended to the module
            names; ``""`` for none.
        include: fnmatch patterns (case-sensitive) on the fully qualified name; a layer is kept if it matches
            any of them. ``None`` keeps every layer.
        exclude: fnmatch patterns; a layer matching any of them is dropped (applied after ``include``).

    Returns:
        The selected layers (possibly empty).

    Raises:
        TypeError: ``include``/``exclude`` is a single string or holds non-strings.
    """
    include_patterns = check_patterns(include, "include")
    exclude_patterns = check_patterns(exclude, "exclude")
    types = linear_types()
    layers = []
    for name, module in block.named_modules():
        if not isinstance(module, types):
            continue
        full_name = f"{prefix}.{name}" if prefix else name
        if include_patterns is not None and not any(fnmatchcase(full_name, p) for p in include_patterns):
            continue
        if exclude_patterns is not None and any(fnmatchcase(full_name, p) for p in exclude_patterns):
            continue
        layers.append(PrunableLayer(full_name, module))
    return layers


def find_blocks(model: nn.Module, blocks_path: str | None = None) -> tuple[str, nn.ModuleList]:
    """Return the decoder blocks of ``model`` and their dotted path.

    Without ``blocks_path`` the blocks are the largest *outermost* ``nn.ModuleList`` whose children all have
    exactly the same class: ``model.layers`` (Llama, Qwen2, Mistral, Gemma2), ``model.decoder.layers`` (OPT),
    ``transformer.h`` (GPT-2). "Outermost" means lists nested inside a candidate list (for example per-block
    expert lists of a mixture-of-experts model) are never chosen. Ties go to the list met first in module
    order.

    Args:
        model: the causal LM; not modified.
        blocks_path: dotted path of the block list relative to ``model`` (e.g. ``"model.layers"``); overrides
            the search, for models where the structural rule picks the wrong list.

    Returns:
        ``(path, blocks)`` where ``blocks`` is the ``nn.ModuleList`` itself (not a copy).

    Raises:
        ValueError: ``blocks_path`` does not name a submodule, or no homogeneous ``ModuleList`` exists.
        TypeError: ``blocks_path`` names a module that is not an ``nn.ModuleList``.
    """
    if blocks_path is not None:
        try:
            blocks = model.get_submodule(blocks_path)
        except AttributeError as err:
            raise ValueError(
                f"blocks_path={blocks_path!r} is not a submodule of {type(model).__name__}; pass the dotted "
                "path of the decoder-block ModuleList as printed by model.named_modules()"
            ) from err
        if not isinstance(blocks, nn.ModuleList):
            raise TypeError(
                f"blocks_path={blocks_path!r} names a {type(blocks).__name__}, not an nn.ModuleList; "
                "pass the path of the list that holds the decoder blocks"
            )
        return blocks_path, blocks

    best: tuple[str, nn.ModuleList] | None = None
    candidates: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if any(name.startswith(outer + ".") for outer in candidates):
            continue  # nested inside another candidate, e.g. the experts of one block
        if len({type(child) for child in module}) != 1:
            continue
        candidates.append(name)
        if best is None or len(module) > len(best[1]):
            best = (name, module)
    if best is None:
        raise ValueError(
            f"no nn.ModuleList of same-class modules found in {type(model).__name__}; pass blocks_path= with "
            "the dotted path of the decoder-block list (e.g. 'model.layers')"
        )
    logger.debug("decoder blocks: %s (%d x %s)", best[0], len(best[1]), type(best[1][0]).__name__)
    return best


def _layer_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The input tensor of a linear-layer call, whether passed positionally or by keyword."""
    if args:
        return args[0]
    return next(iter(kwargs.values()))


@contextmanager
def input_hooks(
    layers_or_groups: Sequence[PrunableLayer | Sequence[PrunableLayer]],
    fn: Callable[[str, torch.Tensor], None],
) -> Iterator[None]:
    """Call ``fn(key, x)`` with the input of each layer (or of each group's first layer) on every forward.

    Args:
        layers_or_groups: items that are either a :class:`PrunableLayer` (hooked itself, ``key`` its name) or
            a non-empty sequence of layers sharing one input (only the first is hooked, ``key`` is the first
            layer's name), e.g. the output of :func:`sparseswaps_prune.llm.layers.group_by_input`.
        fn: called as ``fn(key, x)`` with ``x`` the layer input ``[..., d_in]`` exactly as the layer receives
            it (same tensor object, dtype and device; treat it as read-only). Its return value is ignored;
            exceptions propagate out of the forward.

    The forward pre-hooks are registered on entry and removed on exit, also when the body or ``fn`` raises.

    Raises:
        ValueError: a group is empty.
    """
    targets: list[PrunableLayer] = []
    for item in layers_or_groups:
        if isinstance(item, PrunableLayer):
            targets.append(item)
        elif len(item) == 0:
            raise ValueError("input_hooks got an empty layer group; drop it (group_by_input never makes one)")
        else:
            targets.append(item[0])

    handles = []
    try:
        for layer in targets:

            def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], key: str = layer.name) -> None:
                fn(key, _layer_input(args, kwargs))

            handles.append(layer.module.register_forward_pre_hook(hook, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def replace_weight_mask(module: nn.Module, mask: torch.Tensor) -> None:
    """Overwrite a pruned module's ``weight_mask`` and recompute its masked ``weight``, in place.

    Args:
        module: a module pruned through ``torch.nn.utils.prune`` (has ``weight_orig`` and ``weight_mask``).
        mask: shaped like ``module.weight`` (parameter layout, see :meth:`PrunableLayer.to_param_layout`).
    """
    module.weight_mask.copy_(mask)
    module.weight = module.weight_orig * module.weight_mask


def apply_mask(layer: PrunableLayer, mask_2d: torch.Tensor, weight_2d: torch.Tensor | None = None) -> None:
    """Set ``layer``'s pruning mask through ``torch.nn.utils.prune``, in place.

    A layer pruned before gets its ``weight_mask`` buffer replaced rather than combined.

    Args:
        layer: the layer to mask.
        mask_2d: ``[d_out, d_in]`` bool mask, True = kept.
        weight_2d: optional ``[d_out, d_in]`` weights (e.g. re-fitted) that replace the dense weights in
            ``weight_orig``.
    """
    module = layer.module
    mask = layer.to_param_layout(mask_2d).to(device=module.weight.device, dtype=module.weight.dtype)
    if not (prune.is_pruned(module) and hasattr(module, "weight_mask")):
        prune.custom_from_mask(module, "weight", mask.contiguous())
    if weight_2d is not None:
        with torch.no_grad():
            module.weight_orig.copy_(layer.to_param_layout(weight_2d))
    replace_weight_mask(module, mask)


def check_finite_layers(layers: list[PrunableLayer], index: int) -> None:
    """Raise ``ValueError`` naming the block and layer if a pruned layer's weights are not finite (nothing of the
    block is committed or saved then): e.g. a weight update beyond float16's range (65504) written into a float16
    model."""
    for layer in layers:
        module = layer.module
        weight = getattr(module, "weight_orig", module.weight).detach()
        if not bool(torch.isfinite(weight).all()):
            rows = int((~torch.isfinite(weight)).any(dim=-1).sum())
            fp16 = weight.dtype == torch.float16
            hint = " (float16 holds at most 65504: prune in bfloat16 or float32, --dtype)" if fp16 else ""
            raise ValueError(
                f"block {index}, layer {layer.name}: the pruned weights are not finite in {rows} rows of "
                f"{weight.shape[0]} ({weight.dtype}){hint}; nothing of this block was saved"
            )


@contextmanager
def same_param_slot(module: nn.Module, old_name: str, new_name: str) -> Iterator[None]:
    """Inside, ``torch.nn.utils.prune`` swaps parameter ``old_name`` for ``new_name`` (``weight`` <->
    ``weight_orig``); afterwards ``new_name`` is moved into ``old_name``'s slot of ``module._parameters``.

    prune appends the new name at the end, which changes ``module.parameters()`` order: an optimizer built
    before pruning (the usual case in Lightning: ``configure_optimizers`` runs before ``on_fit_start``) and one
    built after resuming from a checkpoint would disagree on the order, and ``optimizer.load_state_dict``
    would pair momentum buffers with the wrong tensors.

    Args:
        module: the module whose parameter is reparametrized inside the ``with`` block.
        old_name: the parameter name before (``"weight"`` when pruning, ``"weight_orig"`` when removing).
        new_name: the parameter name after.
    """
    order = list(module._parameters)
    yield
    params = module._parameters
    if new_name in params and old_name in order:
        order[order.index(old_name)] = new_name
        reordered = [(k, params[k]) for k in order if k in params] + [
            (k, v) for k, v in params.items() if k not in order
        ]
        params.clear()
        params.update(reordered)


def restore_masks(module: nn.Module, state_dict: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Re-create the ``torch.nn.utils.prune`` reparametrization of every layer whose ``<name>.weight_mask``
    is in ``state_dict``, so that ``module.load_state_dict(state_dict)`` (with its ``weight_orig`` and
    ``weight_mask`` keys) then loads strictly.

    Call it from ``LightningModule.on_load_checkpoint(self, checkpoint)`` as
    ``restore_masks(self, checkpoint["state_dict"])`` to make ``MyModule.load_from_checkpoint(path)`` work
    on a checkpoint written after :class:`~sparseswaps_prune.callbacks.SparseSwapsPruning` pruned; inside
    ``Trainer.fit(ckpt_path=...)`` the callback does this itself.

    Args:
        module: the module to reparametrize, in place (parameter order kept, see :func:`same_param_slot`).
        state_dict: a state dict of ``module`` (only its ``*.weight_mask`` keys are read).
        prefix: the prefix of ``module``'s keys in ``state_dict``.

    Returns:
        The qualified names of the layers given a mask (layers already pruned are left alone).
    """
    restored = []
    for key, mask in state_dict.items():
        if not key.startswith(prefix) or not key.endswith(".weight_mask"):
            continue
        name = key[len(prefix) : -len(".weight_mask")]
        try:
            layer = module.get_submodule(name)
        except AttributeError:
            continue  # strict loading reports the unexpected key
        if prune.is_pruned(layer) and hasattr(layer, "weight_mask"):
            continue
        with same_param_slot(layer, "weight", "weight_orig"):
            prune.custom_from_mask(layer, "weight", mask.to(device=layer.weight.device, dtype=layer.weight.dtype))
        restored.append(name)
    return restored
