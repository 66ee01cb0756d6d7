"""Helpers for the deploy tests: pruning a model with a random per-row mask, bit-level comparison."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparseswaps_prune.modules import find_layers

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` reinterpreted as integers of its element size (NaNs and signed zeros compare by their bits)."""
    return tensor.detach().cpu().contiguous().view(_INT_OF_SIZE[tensor.element_size()])


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Two state dicts with the same names, dtypes, shapes and bits."""
    assert list(a) == list(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert torch.equal(bits(a[name]), bits(b[name])), name


def random_mask(shape: tuple[int, int], sparsity: float, generator: torch.Generator, nm=None) -> torch.Tensor:
    """A bool mask (True = kept): ``sparsity`` of each row pruned at random, or the N:M pattern ``nm``."""
    rows, cols = shape
    if nm is not None:
        n, m = nm
        scores = torch.rand(rows, cols // m, m, generator=generator)
        keep = torch.zeros_like(scores, dtype=torch.bool).scatter_(2, scores.topk(n, dim=2).indices, True)
        return keep.reshape(rows, cols)
    pruned = round(cols * sparsity)
    order = torch.rand(rows, cols, generator=generator).argsort(dim=1)
    return torch.ones(rows, cols, dtype=torch.bool).scatter_(1, order[:, :pruned], False)


def prune_model(
    model: nn.Module, sparsity: float = 0.6, *, seed: int = 0, nm=None, negative_zeros: bool = False
) -> list[str]:
    """Prune every linear layer of ``model`` not tied to the input embedding, in place; return their names.

    ``negative_zeros``: prune as ``weight * mask`` (negative weights leave ``-0.0``, as ``torch.nn.utils.prune``
    does) instead of writing ``+0.0``.
    """
    generator = torch.Generator().manual_seed(seed)
    embedding = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    names = []
    with torch.no_grad():
        for layer in find_layers(model, prefix=""):
            if embedding is not None and layer.module.weight is embedding:
                continue
            weight = layer.weight_2d()
            keep = random_mask(tuple(weight.shape), sparsity, generator, nm)
            if negative_zeros:
                weight.mul_(keep)
            else:
                weight.copy_(torch.where(keep, weight, torch.zeros((), dtype=weight.dtype)))
            names.append(layer.name)
    return names


@pytest.fixture
def tiny():
    """``tiny(arch, dtype=float32, sparsity=0.6, nm=None, config=None, negative_zeros=False)``: a tiny model of
    ``arch`` (``config``: overrides of its config), pruned by :func:`prune_model`, in ``dtype``."""
    from sparseswaps_prune.llm.models import tiny_model

    def build(arch: str, dtype: torch.dtype = torch.float32, sparsity: float = 0.6, nm=None, config=None, **kwargs):
        model = tiny_model(arch, seed=0, **(config or {}))
        prune_model(model, sparsity, nm=nm, **kwargs)
        return model.to(dtype)

    return build
