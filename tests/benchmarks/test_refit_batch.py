"""benchmarks/refit_batch.py: the re-fit timed by batch size gives the same weights at every size."""

from __future__ import annotations

import torch

from sparseswaps_prune.core import refit
from sparseswaps_prune.core.warmstart import warmstart_mask


def test_time_batches_same_weights_and_restores(benchmark_script):
    batch = benchmark_script("refit_batch")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 24, generator=gen, dtype=torch.float64)
    gram = x.T @ x
    weight = torch.randn(10, 24, generator=gen)
    keep = warmstart_mask(weight.double(), "wanda", gram=gram, sparsity=0.5)
    saved = refit.SYSTEM_ELEMENTS
    # 2^8 elements: one 12 x 12 system per batch; 2^20: all rows at once
    seconds, identical = batch.time_batches(weight, gram, keep, [20, 8], repeats=2)
    assert identical
    assert set(seconds) == {20, 8} and all(0 < s < float("inf") for s in seconds.values())
    assert refit.SYSTEM_ELEMENTS == saved
