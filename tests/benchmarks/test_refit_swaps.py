"""benchmarks/refit_swaps.py: both re-fit engines timed on one small width, figures well formed."""

from __future__ import annotations

import math

import pytest
import torch

from sparseswaps_prune.core import refit_swaps as rs


@pytest.mark.parametrize(("pattern", "search", "kept"), [("60%", "torch", 10), ("2:4", "nm", 12)])
def test_measure_times_both_engines(benchmark_script, pattern, search, kept):
    bench = benchmark_script("refit_swaps")
    out = bench.measure(24, 3, "cpu", 0.01, search, iters=2, pattern=pattern)
    k, mib, figures, ls, mask_it, floor, builds, mask_rows_it = out
    assert k == kept  # 60% of 24 pruned per row (round(14.4) = 14), or 2 of every 4 kept
    assert math.isclose(mib, (k * k + k * (24 - k)) * 8 / 2**20)
    assert set(figures) == {"torch", "numba"}
    assert all(build > 0 and it > 0 and same for build, it, same in figures.values())
    assert ls > 0 and mask_it > 0 and floor > 0 and mask_rows_it > 0
    assert len(builds) == 2 and all(build > 0 for build in builds)  # H by cholesky_inverse, by the triangular inverse


def test_measure_times_the_engines_asked_for(benchmark_script):
    bench = benchmark_script("refit_swaps")
    figures = bench.measure(24, 3, "cpu", 0.01, "torch", iters=2, engines=["numba", "torch"])[2]
    assert list(figures) == ["numba", "torch"] and all(same for _, _, same in figures.values())


def test_the_floor_computes_the_states_schur_complements(benchmark_script):
    """The floor times work the state needs: its s_p equal the engine's (same pruned order)."""
    bench = benchmark_script("refit_swaps")
    weight, gram, keep = bench.random_layer(40, 4, dtype=torch.float64)
    keep[0, :3] = ~keep[0, :3]  # rows with different kept counts
    lam = 0.01 * float(torch.diagonal(gram).mean())
    counts = keep.sum(1)
    state = rs.build_state(weight, keep, gram, lam, int(counts.max()), int((40 - counts).max()))
    floor = bench.schur_floor(weight, gram, keep, lam)
    assert torch.allclose(torch.where(state.pruned_ok, floor, 1.0), state.schur, rtol=1e-9)
