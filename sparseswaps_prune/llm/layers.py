"""The layers of a decoder block that share one input (q/k/v, gate/up, ...), discovered by running the block once
and comparing the input tensors, not by name tables. The decoder blocks themselves come from
:func:`sparseswaps_prune.modules.find_blocks`, the prunable layers of a block from
:func:`sparseswaps_prune.modules.find_layers`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from sparseswaps_prune.modules import PrunableLayer, input_hooks

logger = logging.getLogger(__name__)

__all__ = ["group_by_input"]


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
