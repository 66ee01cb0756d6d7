"""Seeded random sweeps (issue 18): ``refine_mask`` against the float64 brute-force swap search, and
``refit_weights`` against least squares on the data, on many small problems: both CPU search backends, rank-deficient
Grams, exact-zero weights, several start masks, truncated runs, N:M and the re-fit objective. The hand-picked cases
are in ``test_swaps.py``, ``test_refine.py``, ``test_refit_swaps.py`` and ``test_refit.py``."""

from __future__ import annotations

import random

import pytest
import torch

from sparseswaps_prune import refine_mask, refit_weights, row_losses, warmstart_mask
from tests.core.reference import brute_refine, brute_refine_refit

SEEDS = range(16)


def random_problem(seed: int, *, m: int | None = None):
    """``(weight, x, gram, rng)``: random sizes; a Gram of fewer tokens than inputs (rank-deficient) for a third of
    the seeds; features of unequal scales and correlated; some weights exactly zero for a quarter of them."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    d_out = rng.randint(1, 4)
    d_in = rng.choice([8, 12]) if m else rng.randint(4, 11)
    tokens = [d_in // 2, d_in - 1, 3 * d_in][seed % 3]
    mixing = torch.eye(d_in, dtype=torch.float64) + torch.randn(d_in, d_in, generator=gen, dtype=torch.float64) / 3
    x = torch.randn(tokens, d_in, generator=gen, dtype=torch.float64) @ mixing
    x = x * torch.rand(d_in, generator=gen, dtype=torch.float64).add(0.2)
    weight = torch.randn(d_out, d_in, generator=gen, dtype=torch.float64)
    if seed % 4 == 1:
        weight[torch.rand(d_out, d_in, generator=gen) < 0.2] = 0.0
    return weight, x, x.T @ x, rng


def start_mask(weight, gram, rng, *, nm=None):
    """A start mask: magnitude, Wanda, RIA, or (half the time) random with the same count per row (or N:M)."""
    d_out, d_in = weight.shape
    if rng.random() < 0.5:
        gen = torch.Generator().manual_seed(rng.randint(0, 2**31))
        if nm is not None:
            scores = torch.rand(d_out, d_in // nm[1], nm[1], generator=gen)
            ranks = scores.argsort(-1).argsort(-1)
            return (ranks < nm[0]).reshape(d_out, d_in)
        kept = rng.randint(1, d_in - 1)
        return torch.rand(d_out, d_in, generator=gen).argsort(1).argsort(1) < kept
    if nm is not None:
        return warmstart_mask(weight, rng.choice(["magnitude", "wanda"]), nm=nm, gram=gram)
    sparsity = rng.randint(1, d_in - 1) / d_in  # prunes between 1 and d_in - 1 weights per row
    return warmstart_mask(weight, rng.choice(["magnitude", "wanda", "ria"]), sparsity=sparsity, gram=gram)


@pytest.mark.parametrize("seed", SEEDS)
def test_refine_matches_brute_force_on_random_problems(seed):
    weight, _, gram, rng = random_problem(seed)
    keep = start_mask(weight, gram, rng)
    max_iters = rng.choice([1, 3, 50])
    want, history = brute_refine(weight, gram, keep, max_iters=max_iters)
    for backend in ("torch", "numba"):
        res = refine_mask(weight, gram, keep, max_iters=max_iters, dtype=torch.float64, backend=backend)
        assert torch.equal(res.mask, want), backend
        assert res.n_swaps.tolist() == [len(h) for h in history], backend
        assert torch.allclose(res.loss_after, row_losses(weight, gram, want), rtol=1e-12)
        assert bool((res.loss_after <= res.loss_before).all())
        assert torch.equal(res.mask.sum(1), keep.sum(1)) and not bool((res.mask & ~keep & (weight == 0)).any())


@pytest.mark.parametrize("seed", SEEDS)
def test_refine_nm_matches_brute_force_on_random_problems(seed):
    weight, _, gram, rng = random_problem(seed, m=4)
    nm = (rng.randint(1, 3), 4)
    keep = start_mask(weight, gram, rng, nm=nm)
    want, history = brute_refine(weight, gram, keep, max_iters=50, m=4)
    res = refine_mask(weight, gram, keep, max_iters=50, nm=nm, dtype=torch.float64)
    assert torch.equal(res.mask, want)
    assert res.n_swaps.tolist() == [len(h) for h in history]
    assert bool((res.mask.reshape(weight.shape[0], -1, 4).sum(-1) == nm[0]).all())


@pytest.mark.parametrize("seed", SEEDS)
def test_refine_refit_objective_matches_brute_force_on_random_problems(seed):
    weight, _, gram, rng = random_problem(seed)
    keep = start_mask(weight, gram, rng)
    damp = rng.choice([0.01, 0.1])  # rank-deficient Grams need a ridge
    want, history = brute_refine_refit(weight, gram, keep, damp, max_iters=30)
    res = refine_mask(weight, gram, keep, max_iters=30, objective="refit", damp=damp, ridge="mean")
    assert torch.equal(res.mask, want)
    assert res.n_swaps.tolist() == [len(h) for h in history]


@pytest.mark.parametrize("seed", SEEDS)
def test_refit_weights_match_least_squares_on_the_data(seed):
    """``refit_weights`` (Cholesky of ``G_SS + lambda I``) against ``lstsq`` on ``[X_S; sqrt(lambda) I]``: the ridge
    problem ``min ||X (w - v)||^2 + lambda ||v||^2`` on each row's kept set, solved from the data, not the Gram."""
    weight, x, gram, rng = random_problem(seed)
    keep = start_mask(weight, gram, rng)
    damp = rng.choice([1e-3, 0.05])
    got = refit_weights(weight, gram, keep, damp=damp, row_batch=rng.randint(1, 3), ridge="mean")
    lam = damp * float(torch.diagonal(gram).mean())
    for r in range(weight.shape[0]):
        s = torch.nonzero(keep[r]).flatten()
        a = torch.cat([x[:, s], lam**0.5 * torch.eye(s.numel(), dtype=torch.float64)])
        b = torch.cat([x @ weight[r], torch.zeros(s.numel(), dtype=torch.float64)])
        want = torch.zeros_like(weight[r])
        want[s] = torch.linalg.lstsq(a, b[:, None]).solution[:, 0]
        assert torch.allclose(got[r], want, rtol=1e-8, atol=1e-10), r
    assert not bool(got[~keep].any())
