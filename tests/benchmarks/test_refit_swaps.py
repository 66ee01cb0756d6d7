"""benchmarks/refit_swaps.py: both re-fit engines timed on one small width, figures well formed."""

from __future__ import annotations

import math


def test_measure_times_both_engines(benchmark_script):
    bench = benchmark_script("refit_swaps")
    k, mib, figures, ls, mask_it = bench.measure(24, 3, "cpu", 0.01, "torch", iters=2)
    assert k == 10  # 60% of 24 pruned per row (round(14.4) = 14)
    assert math.isclose(mib, (k * k + k * (24 - k)) * 8 / 2**20)
    assert set(figures) == {"torch", "numba"}
    assert all(t > 0 for pair in figures.values() for t in pair) and ls > 0 and mask_it > 0
