"""benchmarks/refit_model_iteration.py: one layer timed under both objectives, in row batches."""

from __future__ import annotations

import pytest
import torch

from sparseswaps_prune.core import refit_swaps as rs


@pytest.mark.parametrize("pattern", ["60%", "2:4"])
def test_measure_times_every_stage_over_row_batches(benchmark_script, monkeypatch, pattern):
    bench = benchmark_script("refit_model_iteration")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=gen)
    weight = torch.randn(10, 16, generator=gen)
    monkeypatch.setattr(rs, "REFIT_ELEMENTS", 3 * 6 * 10)  # [3 rows, k 6, q 10]: four row batches of the re-fit
    built = []
    real = bench.RefitRows.__init__

    def spy(self, w64, keep, *args, **kwargs):
        built.append(keep.shape[0])
        real(self, w64, keep, *args, **kwargs)

    monkeypatch.setattr(bench.RefitRows, "__init__", spy)
    figures = bench.measure(weight, x.T @ x, pattern, iters=2, damp=0.01)
    assert set(figures) == {"build", "refit", "mask", "ls", "lazy", "visits"}
    assert all(seconds > 0 for key, seconds in figures.items() if key != "visits")
    assert 10 <= figures["visits"] <= 10 * 16  # at least one column per row (the winner's), at most all
    if pattern == "60%":
        assert built == [3, 3, 3, 1]
