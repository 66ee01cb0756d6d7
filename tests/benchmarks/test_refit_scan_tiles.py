"""benchmarks/refit_scan_tiles.py: every tile shape's scan and every update tile's iteration checked against the
reference (Triton interpreter on the CPU, ``TRITON_INTERPRET=1`` from tests/conftest.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


@pytest.mark.parametrize("pattern", ["60%", "2:4"])
def test_sweep_checks_every_tile_shape(benchmark_script, pattern):
    bench = benchmark_script("refit_scan_tiles")
    z_bytes, scans, iterations = bench.sweep(
        64, 3, "cpu", ["4x16x1", "8x8x1"], [4], ["2x16x1", "8x32x1"], repeat=1, pattern=pattern
    )
    # [rows, K, Q] float64, the slot counts rounded up to 16 as the engine's (26 kept, 38 pruned at 60%)
    assert z_bytes == 3 * 32 * 48 * 8 if pattern == "60%" else 3 * 32 * 32 * 8
    assert [(tile, programs) for tile, programs, *_ in scans] == [("4x16x1", 4), ("8x8x1", 4)]
    assert all(same and seconds > 0 for _, _, seconds, same in scans)
    assert [tile for tile, *_ in iterations] == ["2x16x1", "8x32x1"]
    assert all(same and seconds > 0 for _, seconds, same in iterations)


def test_an_iteration_that_differs_from_the_reference_is_reported(benchmark_script, monkeypatch):
    bench = benchmark_script("refit_scan_tiles")
    swap_slots = bench.refit_triton.swap_slots

    def perturbed(state, *args, **kwargs):  # a wrong state: the check must see it
        out = swap_slots(state, *args, **kwargs)
        state.coef.add_(state.coef.abs().max() * 1e-12)
        return out

    monkeypatch.setattr(bench.refit_triton, "swap_slots", perturbed)
    _, _, iterations = bench.sweep(64, 3, "cpu", ["4x16x1"], [4], ["8x32x1"], repeat=1)
    assert [same for _, _, same in iterations] == [False]
