"""benchmarks/refit_scan_tiles.py: every tile shape's scan checked against the reference (Triton interpreter on the
CPU, ``TRITON_INTERPRET=1`` from tests/conftest.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


@pytest.mark.parametrize("pattern", ["60%", "2:4"])
def test_sweep_checks_every_tile_shape(benchmark_script, pattern):
    bench = benchmark_script("refit_scan_tiles")
    z_bytes, scans = bench.sweep(64, 3, "cpu", ["4x16x1", "8x8x1"], [4], repeat=1, pattern=pattern)
    # [rows, Q, K] float64, the slot counts rounded up to 16 as the engine's (26 kept, 38 pruned at 60%)
    assert z_bytes == 3 * 32 * 48 * 8 if pattern == "60%" else 3 * 32 * 32 * 8
    assert [(tile, programs) for tile, programs, *_ in scans] == [("4x16x1", 4), ("8x8x1", 4)]
    assert all(same and seconds > 0 for _, _, seconds, same in scans)
    assert bench.refit_lazy_triton.SCAN_TILE == (16, 32, 4)  # the default restored


def test_a_scan_that_differs_from_the_reference_is_reported(benchmark_script, monkeypatch):
    bench = benchmark_script("refit_scan_tiles")
    scan_swaps = bench.refit_lazy_triton.scan_swaps

    def perturbed(state, rows, **kwargs):  # a wrong cost: the check must see it
        best, slot_i, slot_j = scan_swaps(state, rows, **kwargs)
        return best + best.abs().max() * 1e-12, slot_i, slot_j

    monkeypatch.setattr(bench.refit_lazy_triton, "scan_swaps", perturbed)
    _, scans = bench.sweep(64, 3, "cpu", ["4x16x1"], [4], repeat=1)
    assert [same for *_, same in scans] == [False]
