import numpy as np
import pytest
import torch

from sparseswaps_prune import refit_weights, row_losses, warmstart_mask
from sparseswaps_prune.core import refit_swaps as rs
from sparseswaps_prune.core.admm import admm_update
from sparseswaps_prune.core.refit import damping, factor_kept
from tests.core.reference import layer_problem


def refit_loss(weight, gram, refitted):
    d = (weight - refitted).double()
    return ((d @ gram.double()) * d).sum(1)


@pytest.mark.parametrize("scope", ["row", "layer"])
def test_refit_matches_direct_solve(scope):
    weight, gram = layer_problem(12, 24, seed=3)
    keep = warmstart_mask(weight, "wanda", sparsity=0.5, gram=gram, scope=scope)
    out = refit_weights(weight, gram, keep, damp=0.0, row_batch=5, ridge="mean")
    g, w = gram.numpy(), weight.numpy()
    for r in range(12):
        s = keep[r].numpy()
        want = np.linalg.solve(g[np.ix_(s, s)], (g @ w[r])[s])
        np.testing.assert_allclose(out[r].numpy()[s], want, rtol=1e-8, atol=1e-10)
    assert not out[~keep].any()


@pytest.mark.parametrize("scope", ["row", "layer"])
def test_diag_ridge_is_least_squares_on_the_damped_gram(scope):
    weight, gram = layer_problem(12, 24, seed=4)
    keep = warmstart_mask(weight, "wanda", sparsity=0.5, gram=gram, scope=scope)
    out = refit_weights(weight, gram, keep, ridge="diag", row_batch=5)  # default damp 0.1
    damped = (gram + 0.1 * torch.diag(torch.diagonal(gram))).numpy()
    w = weight.numpy()
    for r in range(12):
        s = keep[r].numpy()
        want = np.linalg.solve(damped[np.ix_(s, s)], (damped @ w[r])[s])
        np.testing.assert_allclose(out[r].numpy()[s], want, rtol=1e-8, atol=1e-10)
    assert not out[~keep].any()
    cg = refit_weights(weight, gram, keep, ridge="diag", solver="cg", tol=1e-12, max_steps=500)
    assert torch.allclose(cg, out, rtol=1e-7, atol=1e-9)
    # the fixed point of ADMM's update (Boza 2024) on the same mask: ridge 0.1 on the normalised Gram
    admm = admm_update(weight, gram, keep, iters=300, dtype=torch.float64)
    assert torch.allclose(admm, out, rtol=1e-6, atol=1e-7)
    assert not torch.allclose(admm_update(weight, gram, keep, iters=3, dtype=torch.float64), out, atol=1e-4)
    assert not torch.allclose(refit_weights(weight, gram, keep, ridge="mean", damp=0.1), out, atol=1e-4)
    with pytest.raises(ValueError, match="ridge must be 'mean' or 'diag'"):
        refit_weights(weight, gram, keep, ridge="l2")


def test_refit_never_worse_than_mask_only_and_nm_zeros():
    weight, gram = layer_problem(16, 32, seed=5, dtype=torch.float32)
    keep = warmstart_mask(weight, "wanda", nm=(2, 4), gram=gram)
    out = refit_weights(weight, gram, keep, damp=1e-4, ridge="mean")
    assert out.dtype == torch.float32
    assert torch.equal(out != 0, keep)
    assert (refit_loss(weight, gram, out) <= row_losses(weight, gram, keep) * (1 + 1e-5)).all()


def test_refit_singular_needs_damping():
    weight, gram = layer_problem(4, 8, seed=1)
    gram[:, 0] = gram[0, :] = 0.0  # input 0 never active
    gram[0, 0] = 0.0
    keep = torch.ones(4, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="damp > 0"):
        refit_weights(weight, gram, keep, damp=0.0, ridge="mean")
    assert torch.isfinite(refit_weights(weight, gram, keep, damp=0.01, ridge="mean")).all()
    with pytest.raises(ValueError, match="damp"):
        refit_weights(weight, gram, keep, damp=-1.0, ridge="mean")


@pytest.mark.parametrize("scope", ["row", "layer"])
def test_cg_solver_matches_direct(scope):
    weight, gram = layer_problem(10, 48, seed=7, dtype=torch.float32)
    keep = warmstart_mask(weight, "wanda", sparsity=0.6, gram=gram, scope=scope)
    direct = refit_weights(weight, gram, keep, damp=0.01, ridge="mean")
    cg = refit_weights(weight, gram, keep, damp=0.01, solver="cg", tol=1e-10, max_steps=500, ridge="mean")
    assert cg.dtype == weight.dtype and not cg[~keep].any()
    assert torch.allclose(cg, direct, rtol=1e-4, atol=1e-5)
    rough = refit_weights(weight, gram, keep, damp=0.01, solver="cg", max_steps=3, ridge="mean")
    assert (refit_loss(weight, gram, rough) <= row_losses(weight, gram, keep) * (1 + 1e-5)).all()
    with pytest.raises(ValueError, match="solver"):
        refit_weights(weight, gram, keep, solver="admm", ridge="mean")


def test_factor_kept_pads_rows_and_is_shared_with_the_swap_state():
    weight, gram = layer_problem(6, 10, seed=2)
    keep = warmstart_mask(weight, "wanda", sparsity=0.5, gram=gram, scope="layer")
    keep[0] = False  # a row with nothing kept
    lam = damping(gram, 0.01)
    slots, valid, factor = factor_kept(gram, keep, lam, 8)
    assert slots.shape == valid.shape == (6, 8) and factor.shape == (6, 8, 8)
    for r in range(6):
        k = int(keep[r].sum())
        assert valid[r].tolist() == [True] * k + [False] * (8 - k)
        assert slots[r, :k].tolist() == torch.nonzero(keep[r]).flatten().tolist()
        s = slots[r, :k]
        system = torch.eye(8, dtype=torch.float64)
        system[:k, :k] = gram[s][:, s] + lam * torch.eye(k, dtype=torch.float64)
        assert torch.allclose(factor[r] @ factor[r].T, system, rtol=1e-12, atol=1e-10)
    # both users of the factor agree: the direct re-fit and the re-fit objective's swap state
    state = rs.build_state(weight, keep, gram, lam, int(keep.sum(1).max()), 10)
    assert torch.allclose(
        rs.fitted_weights(state, 10), refit_weights(weight, gram, keep, damp=0.01, ridge="mean"), rtol=1e-10
    )


def test_factor_kept_names_singular_rows_by_layer_index():
    weight, gram = layer_problem(4, 8, seed=1)
    gram[:, 0] = gram[0, :] = 0.0
    keep = torch.zeros(4, 8, dtype=torch.bool)
    keep[[1, 3], 0] = True
    keep[:, 1] = True
    with pytest.raises(ValueError, match=r"singular for rows \[11, 13\].*damp > 0"):
        factor_kept(gram, keep, 0.0, 2, row_offset=10)
    with pytest.raises(ValueError, match=r"singular for rows \[7\]"):
        factor_kept(gram, keep[1:2], 0.0, 2, row_offset=torch.tensor([7]))
    with pytest.raises(ValueError, match=r"singular for rows \[1, 3\].*damp > 0"):
        refit_weights(weight, gram, keep, damp=0.0, ridge="mean")


def test_unequal_counts_are_batched_by_count():
    """Rows keeping very different counts (per-layer masks), one keeping nothing: each batch is padded only to its own
    largest count, and every row equals its own solve (row_batch=1) and least squares on its kept set."""
    gen = torch.Generator().manual_seed(3)
    d_in = 24
    x = torch.randn(80, d_in, generator=gen, dtype=torch.float64)
    gram = x.T @ x
    weight = torch.randn(7, d_in, generator=gen, dtype=torch.float64)
    keep = torch.zeros(7, d_in, dtype=torch.bool)
    for row, count in enumerate([1, 23, 5, 0, 12, 23, 2]):
        keep[row, torch.randperm(d_in, generator=gen)[:count]] = True
    batched = refit_weights(weight, gram, keep, damp=1e-3, row_batch=3, ridge="mean")
    for row in range(7):
        alone = refit_weights(weight[row : row + 1], gram, keep[row : row + 1], damp=1e-3, ridge="mean")
        assert torch.allclose(batched[row], alone[0], rtol=1e-10, atol=1e-12), row
    assert torch.allclose(refit_weights(weight, gram, keep, damp=1e-3, ridge="mean"), batched, rtol=1e-10, atol=1e-12)
    assert not bool(batched[3].any()) and not bool(batched[~keep].any())
