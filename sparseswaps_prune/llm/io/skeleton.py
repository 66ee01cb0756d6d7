"""A model without weights (parameters on ``meta``, buffers real) and its tensors set or dropped one by one: the
model the block-wise path reads a checkpoint into, a few tensors at a time."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["drop_tensors", "empty_model", "is_param", "resolve_dtype", "set_tensor"]


def set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter or buffer ``name`` of ``model`` by ``value`` (a parameter stays a parameter)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if leaf in module._parameters:
        old = module._parameters[leaf]
        module._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
    elif leaf in module._buffers:
        module._buffers[leaf] = value
    else:
        raise KeyError(f"{name} is neither a parameter nor a buffer of {type(model).__name__}")


def drop_tensors(model: nn.Module, names: Iterable[str]) -> None:
    """Put ``names`` back on the meta device (frees their memory)."""
    for name in names:
        tensor = model.get_parameter(name) if is_param(model, name) else model.get_buffer(name)
        set_tensor(model, name, torch.empty_like(tensor, device="meta"))


def is_param(model: nn.Module, name: str) -> bool:
    module_name, _, leaf = name.rpartition(".")
    return leaf in model.get_submodule(module_name)._parameters


def resolve_dtype(config: Any, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}")
        return dtype
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, None)
    return stored if isinstance(stored, torch.dtype) and stored.is_floating_point else torch.float32


def empty_model(config: Any, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``config`` with its parameters on ``meta`` (buffers real), tied, in eval mode."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    model.eval()
    return model
