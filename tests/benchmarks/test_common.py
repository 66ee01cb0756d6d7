"""benchmarks/common.py: the helpers the benchmark scripts share."""

from __future__ import annotations


def test_pattern_options(benchmark_script):
    common = benchmark_script("common")
    assert common.pattern_options("60%") == {"sparsity": 0.6, "nm": None}
    assert common.pattern_options("2:4") == {"sparsity": None, "nm": (2, 4)}


def test_random_layer_has_the_patterns_mask_in_the_asked_dtype(benchmark_script):
    import torch

    common = benchmark_script("common")
    weight, gram, keep = common.random_layer(40, 3, "60%")
    assert weight.dtype == gram.dtype == torch.float32 and weight.shape == (3, 40) and gram.shape == (40, 40)
    assert (keep.sum(dim=1) == 16).all()  # 24 of 40 pruned per row
    weight64, gram64, keep24 = common.random_layer(40, 3, "2:4", dtype=torch.float64)
    assert weight64.dtype == gram64.dtype == torch.float64 and torch.equal(weight64, weight.double())
    assert (keep24.view(3, 10, 4).sum(dim=2) == 2).all()


def test_timed_warms_up_once_then_averages(benchmark_script):
    common = benchmark_script("common")
    calls = []
    seconds = common.timed(lambda: calls.append(1), repeat=4)
    assert len(calls) == 5 and seconds >= 0
