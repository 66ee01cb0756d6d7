"""A self-contained demo: refine the Wanda mask of one random, correlated layer and report the loss."""

from __future__ import annotations

import time

import torch

from sparseswaps_prune.core.refine import RefineResult, refine_mask
from sparseswaps_prune.core.warmstart import warmstart_mask


def random_layer(d_out: int, d_in: int, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random ``[d_out, d_in]`` weight and the Gram ``[d_in, d_in]`` of correlated, unevenly scaled inputs."""
    gen = torch.Generator().manual_seed(seed)
    mixing = torch.randn(d_in, d_in, generator=gen) / d_in**0.5 + torch.eye(d_in)
    x = torch.randn(tokens, d_in, generator=gen) @ mixing * torch.rand(d_in, generator=gen).add(0.1)
    return torch.randn(d_out, d_in, generator=gen), x.T @ x


def run_demo(
    d_out: int = 256, d_in: int = 512, sparsity: float = 0.6, max_iters: int = 100, seed: int = 0
) -> tuple[RefineResult, float]:
    """Wanda warmstart + SparseSwaps on a random layer; returns the result and the refinement seconds."""
    weight, gram = random_layer(d_out, d_in, tokens=4 * d_in, seed=seed)
    keep = warmstart_mask(weight, "wanda", sparsity=sparsity, gram=gram)
    start = time.perf_counter()
    result = refine_mask(weight, gram, keep, max_iters=max_iters)
    return result, time.perf_counter() - start
