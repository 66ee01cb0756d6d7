import numpy as np
import pytest
import torch

from sparseswaps_prune import refit_weights, row_losses, warmstart_mask
from tests.core.reference import layer_problem


def refit_loss(weight, gram, refitted):
    d = (weight - refitted).double()
    return ((d @ gram.double()) * d).sum(1)


@pytest.mark.parametrize("scope", ["row", "layer"])
def test_refit_matches_direct_solve(scope):
    weight, gram = layer_problem(12, 24, seed=3)
    keep = warmstart_mask(weight, "wanda", sparsity=0.5, gram=gram, scope=scope)
    out = refit_weights(weight, gram, keep, damp=0.0, row_batch=5)
    g, w = gram.numpy(), weight.numpy()
    for r in range(12):
        s = keep[r].numpy()
        want = np.linalg.solve(g[np.ix_(s, s)], (g @ w[r])[s])
        np.testing.assert_allclose(out[r].numpy()[s], want, rtol=1e-8, atol=1e-10)
    assert not out[~keep].any()


def test_refit_never_worse_than_mask_only_and_nm_zeros():
    weight, gram = layer_problem(16, 32, seed=5, dtype=torch.float32)
    keep = warmstart_mask(weight, "wanda", nm=(2, 4), gram=gram)
    out = refit_weights(weight, gram, keep, damp=1e-4)
    assert out.dtype == torch.float32
    assert torch.equal(out != 0, keep)
    assert (refit_loss(weight, gram, out) <= row_losses(weight, gram, keep) * (1 + 1e-5)).all()


def test_refit_singular_needs_damping():
    weight, gram = layer_problem(4, 8, seed=1)
    gram[:, 0] = gram[0, :] = 0.0  # input 0 never active
    gram[0, 0] = 0.0
    keep = torch.ones(4, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="damp > 0"):
        refit_weights(weight, gram, keep, damp=0.0)
    assert torch.isfinite(refit_weights(weight, gram, keep, damp=0.01)).all()
    with pytest.raises(ValueError, match="damp"):
        refit_weights(weight, gram, keep, damp=-1.0)


@pytest.mark.parametrize("scope", ["row", "layer"])
def test_cg_solver_matches_direct(scope):
    weight, gram = layer_problem(10, 48, seed=7, dtype=torch.float32)
    keep = warmstart_mask(weight, "wanda", sparsity=0.6, gram=gram, scope=scope)
    direct = refit_weights(weight, gram, keep, damp=0.01)
    cg = refit_weights(weight, gram, keep, damp=0.01, solver="cg", tol=1e-10, max_steps=500)
    assert cg.dtype == weight.dtype and not cg[~keep].any()
    assert torch.allclose(cg, direct, rtol=1e-4, atol=1e-5)
    rough = refit_weights(weight, gram, keep, damp=0.01, solver="cg", max_steps=3)
    assert (refit_loss(weight, gram, rough) <= row_losses(weight, gram, keep) * (1 + 1e-5)).all()
    with pytest.raises(ValueError, match="solver"):
        refit_weights(weight, gram, keep, solver="admm")
