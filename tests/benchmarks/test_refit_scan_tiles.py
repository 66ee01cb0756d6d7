"""benchmarks/refit_scan_tiles.py: every tile shape's scan checked against the reference (Triton interpreter on the
CPU, ``TRITON_INTERPRET=1`` from tests/conftest.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")


@pytest.mark.parametrize("pattern", ["60%", "2:4"])
def test_sweep_checks_every_tile_shape(benchmark_script, pattern):
    bench = benchmark_script("refit_scan_tiles")
    z_bytes, results = bench.sweep(64, 3, "cpu", ["4x16x1", "8x8x1"], [4], repeat=1, pattern=pattern)
    assert z_bytes == 3 * 26 * 38 * 8 if pattern == "60%" else 3 * 32 * 32 * 8  # [rows, K, Q] float64
    assert [(tile, programs) for tile, programs, *_ in results] == [("4x16x1", 4), ("8x8x1", 4)]
    assert all(same and scan > 0 and swaps > 0 for _, _, scan, same, swaps in results)
