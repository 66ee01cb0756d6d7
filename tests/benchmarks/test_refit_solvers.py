"""benchmarks/refit_solvers.py: CG against the direct re-fit on one layer, figures consistent."""

from __future__ import annotations

import pytest
import torch

from sparseswaps_prune.core.warmstart import warmstart_mask


def test_compare_solvers_figures(benchmark_script):
    solvers = benchmark_script("refit_solvers")
    gen = torch.Generator().manual_seed(0)
    d_in, d_out = 40, 12
    mixing = torch.randn(d_in, d_in, generator=gen, dtype=torch.float64) / 4 + 1
    x = torch.randn(300, d_in, generator=gen, dtype=torch.float64) @ mixing
    gram = x.T @ x
    weight = torch.randn(d_out, d_in, generator=gen)
    keep = warmstart_mask(weight.double(), "wanda", gram=gram, sparsity=0.6)
    res = solvers.compare_solvers(weight, gram, keep, steps=[1, 200], damp=1e-3)
    assert list(res) == ["mask", "direct", "cg 1", "cg 200", "cg tol"]
    assert res["direct"]["weight_error"] == 0.0
    assert res["direct"]["loss"] < res["mask"]["loss"]
    # one CG step is a partial fit; 200 steps (more than the 16 kept unknowns) reach the direct solution
    assert res["cg 1"]["weight_error"] > 1e-3
    assert res["cg 1"]["loss"] > res["direct"]["loss"]
    assert res["cg 200"]["weight_error"] < 1e-8
    assert res["cg 200"]["loss"] == pytest.approx(res["direct"]["loss"], rel=1e-9)
    assert res["cg tol"]["weight_error"] < 1e-3  # relative residual 1e-6, times the condition number
