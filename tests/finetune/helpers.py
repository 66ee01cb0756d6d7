"""Helpers for the fine-tuning tests: tiny random models pruned with seeded random per-layer masks."""

from __future__ import annotations

import copy
import functools

import torch
from torch import nn
from torch.nn.utils import prune

from sparseswaps_prune.finetune import select_layers
from sparseswaps_prune.llm.models import tiny_model

VOCAB = 512
"""Vocabulary of the test models: small, so that the LM head costs nothing (token ids must stay below it)."""


@functools.cache
def _tiny(arch: str) -> nn.Module:
    return tiny_model(arch, vocab_size=VOCAB)


def fresh_tiny(arch: str) -> nn.Module:
    """A fresh copy of a tiny ``arch`` model with a :data:`VOCAB`-token vocabulary (built once per session)."""
    return copy.deepcopy(_tiny(arch))


def counting_ids(n: int = 8, seqlen: int = 16, seed: int = 0) -> torch.Tensor:
    """``[n, seqlen]`` windows of consecutive token ids (mod 64, offset 100): an easy, learnable sequence."""
    start = torch.randint(0, 64, (n, 1), generator=torch.Generator().manual_seed(seed))
    return 100 + (start + torch.arange(seqlen)) % 64


def pruned_tiny(arch: str, *, permanent: bool = False, sparsity: float = 0.5) -> tuple[nn.Module, dict]:
    """A tiny model whose decoder-block linears are pruned with random masks (``torch.nn.utils.prune``;
    ``permanent=True``: then ``prune.remove``). Returns ``(model, {name: mask in the parameter layout})``."""
    model = fresh_tiny(arch)
    generator = torch.Generator().manual_seed(3)
    masks = {}
    for layer in select_layers(model):
        mask = torch.rand(layer.module.weight.shape, generator=generator) >= sparsity
        prune.custom_from_mask(layer.module, "weight", mask)
        if permanent:
            prune.remove(layer.module, "weight")
        masks[layer.name] = mask
    return model, masks


def weight_2d(module: nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (shaped like the module's weight) in the ``[d_out, d_in]`` layout."""
    from transformers.pytorch_utils import Conv1D

    return tensor.t() if isinstance(module, Conv1D) else tensor
