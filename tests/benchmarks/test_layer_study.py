"""benchmarks/layer_study.py: every method of one layer is scored on the fit and held-out Grams, consistently."""

from __future__ import annotations

import pytest
import torch

from sparseswaps_prune.core.gram import GramAccumulator


@pytest.fixture(scope="module")
def study(benchmark_script):
    return benchmark_script("layer_study")


def _gram(x: torch.Tensor) -> GramAccumulator:
    acc = GramAccumulator(x.shape[1], dtype=torch.float64)
    acc.add(x)
    return acc


@pytest.mark.parametrize("pattern", [{"sparsity": 0.6, "nm": None}, {"sparsity": None, "nm": (2, 4)}])
def test_study_layer_scores_every_method(study, pattern):
    gen = torch.Generator().manual_seed(0)
    d_in, d_out = 32, 24
    mixing = torch.randn(d_in, d_in, generator=gen) / d_in**0.5 + torch.eye(d_in)
    fit = _gram(torch.randn(400, d_in, generator=gen) @ mixing)
    held = _gram(torch.randn(100, d_in, generator=gen) @ mixing)
    weight = torch.randn(d_out, d_in, generator=gen)
    rows = torch.tensor([0, 5, 11, 23])
    results = study.study_layer(weight, fit, held, rows, pattern, iters=[3], damps=[0.001, 0.1])
    assert list(results) == [
        "wanda",
        "wanda + refit (damp 0.001)",
        "wanda + refit (damp 0.1)",
        "swaps T=3",
        "swaps T=3 + refit",
        "refit-objective T=3",
        "sparsegpt (published)",
    ]
    fit_loss = {name: r["fit"] for name, r in results.items()}
    assert fit_loss["swaps T=3"] < fit_loss["wanda"]  # swaps never raise the loss, and some apply here
    assert fit_loss["wanda + refit (damp 0.001)"] < fit_loss["wanda"]
    assert fit_loss["wanda + refit (damp 0.001)"] < fit_loss["wanda + refit (damp 0.1)"]
    assert fit_loss["swaps T=3 + refit"] < fit_loss["swaps T=3"]
    # per-token losses: the held-out figure is the loss on the held-out Gram over its 100 tokens
    keep = study.warmstart_mask(weight[rows].double(), "wanda", gram=fit.gram, **pattern)
    residual = torch.where(keep, 0.0, weight[rows].double())
    expected = float(torch.einsum("ri,ij,rj->", residual, held.gram, residual)) / 100
    assert results["wanda"]["holdout"] == pytest.approx(expected, rel=1e-9)
    assert all(r["seconds"] >= 0 for r in results.values())
