"""benchmarks/refit_scan_skip.py: the share of the Triton scan's work the bound (and N:M's block ranges) skip."""

from __future__ import annotations

import pytest
import torch

from sparseswaps_prune.core.refine import RefitRows
from sparseswaps_prune.core.refit import damping
from sparseswaps_prune.core.warmstart import warmstart_mask

pytest.importorskip("triton")  # the script imports the Triton engine's columns_to_scan


@pytest.mark.parametrize("nm", [None, (2, 4)])
def test_skip_counts_count_the_tiles_the_kernel_evaluates(benchmark_script, nm):
    bench = benchmark_script("refit_scan_skip")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(600, 300, generator=gen, dtype=torch.float64)
    weight = torch.randn(6, 300, generator=gen, dtype=torch.float64)
    gram = x.T @ x
    keep = warmstart_mask(weight, "magnitude", sparsity=None if nm else 0.6, nm=nm)
    model = RefitRows(weight, keep, gram, lam=damping(gram, 0.01), m=nm[1] if nm else None, row_batch=6,
                      cross=False, engine="torch")  # fmt: skip
    shared = benchmark_script("common").shared_schur_bound(gram, damping(gram, 0.01))
    counts = bench.skip_counts(model, torch.arange(6), shared)
    assert counts["rows"] == 6 and 0 < counts["evaluated"] <= counts["restorable"]
    assert 6 <= counts["exact"] <= counts["shared"] <= counts["restorable"]  # the winner's slot, at least
    for name in bench.TILES:
        assert 0 < counts[f"{name}_hit"] <= counts[f"{name}_tiles"]
        tile_share = counts[f"{name}_hit"] / counts[f"{name}_tiles"]
        z_share = counts[f"{name}_pairs_hit"] / counts[f"{name}_pairs"]
        if nm is None:  # every kept slot of an evaluated tile
            assert z_share == pytest.approx(tile_share)
        else:  # only the kept slots of the tile's blocks: 32 of the scan's pruned slots need 32 of 150 kept slots
            assert 0 < z_share < tile_share / 2
