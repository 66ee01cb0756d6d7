"""Locate the decoder blocks and the prunable linear layers of a Hugging Face causal LM.

Everything here is architecture-agnostic: the decoder blocks are found structurally (the largest outermost
``nn.ModuleList`` of same-class modules, overridable by a dotted path), the prunable layers are every
``nn.Linear`` and GPT-2 style ``transformers.pytorch_utils.Conv1D`` in a block, and the layers that share one
input tensor (q/k/v, gate/up, ...) are discovered by running the block once and comparing the input tensors,
not by name tables.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

logger = logging.getLogger(__name__)

__all__ = [
    "PrunableLayer",
    "find_blocks",
    "find_layers",
    "group_by_input",
    "input_hooks",
]


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


@dataclass(frozen=True)
class PrunableLayer:
    """One prunable linear map inside a decoder block.

    Attributes:
        name: fully qualified module name, e.g. ``"model.layers.0.self_attn.q_proj"``.
        module: the ``nn.Linear`` (weight ``[d_out, d_in]``) or ``Conv1D`` (weight ``[d_in, d_out]``).
    """

    name: str
    module: nn.Linear | Conv1D

    @property
    def is_transposed(self) -> bool:
        """True when the parameter is stored ``[d_in, d_out]`` (``Conv1D``)."""
        return isinstance(self.module, Conv1D)

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


def _check_patterns(value: Sequence[str] | None, arg: str) -> list[str] | None:
    """Validate an include/exclude argument: ``None`` or a list of fnmatch patterns."""
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
        block: a decoder block; not modified.
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
    include_patterns = _check_patterns(include, "include")
    exclude_patterns = _check_patterns(exclude, "exclude")
    layers = []
    for name, module in block.named_modules():
        if not isinstance(module, (nn.Linear, Conv1D)):
            continue
        full_name = f"{prefix}.{name}" if prefix else name
        if include_patterns is not None and not any(fnmatchcase(full_name, p) for p in include_patterns):
            continue
        if exclude_patterns is not None and any(fnmatchcase(full_name, p) for p in exclude_patterns):
            continue
        layers.append(PrunableLayer(full_name, module))
    return layers


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
            layer's name), e.g. the output of :func:`group_by_input`.
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


def group_by_input(
    block: nn.Module, layers: Sequence[PrunableLayer], *args: Any, **kwargs: Any
) -> list[list[PrunableLayer]]:
    """Partition ``layers`` into groups that receive the very same input tensor.

    Runs ``block(*args, **kwargs)`` once under ``torch.no_grad()`` with temporary pre-hooks and groups layers
    whose inputs are the same tensor (same object, or same data pointer, shape, strides and dtype). For a
    Llama block this gives ``[[q, k, v], [o], [gate, up], [down]]``; for GPT-2 every Conv1D is alone.

    Args:
        block: the decoder block, on the device of the inputs; its parameters are not modified (the forward
            output is discarded).
        layers: layers of ``block`` (from :func:`find_layers`).
        *args, **kwargs: one representative block call, e.g. ``hidden [b, seqlen, hidden]`` plus the recorded
            block kwargs (see ``capture.BlockInputs.batches``).

    Returns:
        Groups in the order of their first layer in ``layers``; each group keeps ``layers`` order. A layer
        never called during the forward (e.g. an unrouted expert) forms its own group and is logged.
    """
    seen: dict[str, torch.Tensor] = {}

    def record(key: str, x: torch.Tensor) -> None:
        seen.setdefault(key, x)  # keeping the reference also keeps data pointers unique during the forward

    with torch.no_grad(), input_hooks(layers, record):
        block(*args, **kwargs)

    groups: list[list[PrunableLayer]] = []
    group_inputs: list[torch.Tensor | None] = []
    for layer in layers:
        x = seen.get(layer.name)
        if x is None:
            logger.warning("%s got no input in the grouping forward; it gets its own group", layer.name)
            groups.append([layer])
            group_inputs.append(None)
            continue
        for group, other in zip(groups, group_inputs, strict=True):
            if other is not None and _same_tensor(x, other):
                group.append(layer)
                break
        else:
            groups.append([layer])
            group_inputs.append(x)
    return groups


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same tensor or views of exactly the same memory and layout."""
    return a is b or (
        a.device == b.device
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.data_ptr() == b.data_ptr()
    )
