"""Locate the decoder blocks of a Hugging Face causal LM and the layers of a block that share one input.

Everything here is architecture-agnostic: the decoder blocks are found structurally (the largest outermost
``nn.ModuleList`` of same-class modules, overridable by a dotted path), and the layers that share one input
tensor (q/k/v, gate/up, ...) are discovered by running the block once and comparing the input tensors, not by
name tables. The prunable layers of a block come from :func:`sparseswaps_prune.modules.find_layers`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from sparseswaps_prune.modules import PrunableLayer, input_hooks

logger = logging.getLogger(__name__)

__all__ = ["find_blocks", "group_by_input"]


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
        layers: layers of ``block`` (from :func:`sparseswaps_prune.modules.find_layers`).
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
