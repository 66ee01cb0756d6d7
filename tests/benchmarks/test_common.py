"""benchmarks/common.py: the helpers the benchmark scripts share."""

from __future__ import annotations


def test_pattern_options(benchmark_script):
    common = benchmark_script("common")
    assert common.pattern_options("60%") == {"sparsity": 0.6, "nm": None}
    assert common.pattern_options("2:4") == {"sparsity": None, "nm": (2, 4)}
