import pytest
import torch

from sparseswaps_prune import row_losses, warmstart_mask
from sparseswaps_prune.core.alps import ALPSResult, _setup, alps_prune, alps_update
from sparseswaps_prune.core.losses import weight_losses
from tests.core.reference import layer_problem
from tests.core.reference_admm_alps import alps_admm, cg_batch


def problem(d_out=16, d_in=64, seed=0):
    return layer_problem(d_out, d_in, seed=seed, dtype=torch.float32)


def loss(weight, gram, new_weight):
    return float(weight_losses(weight, new_weight, gram).sum())


@pytest.mark.parametrize(
    ("budget", "original"),
    [
        ({"sparsity": 0.5}, {"sp": 0.5}),
        ({"sparsity": 0.75}, {"sp": 0.75}),
        ({"sparsity": 0.9}, {"sp": 0.9}),
        ({"nm": (2, 4)}, {"sp": 0.5, "nm_n": 2, "nm_m": 4}),
        ({"nm": (4, 8)}, {"sp": 0.5, "nm_n": 4, "nm_m": 8}),
        ({"nm": (1, 4)}, {"sp": 0.75, "nm_n": 1, "nm_m": 4}),
    ],
)
@pytest.mark.parametrize("seed", [1, 2])
def test_matches_original_alps_admm(budget, original, seed):
    weight, gram = problem(seed=seed)
    want_w, want_iters = alps_admm(weight, gram, **original)
    res = alps_prune(weight, gram, **budget)
    assert isinstance(res, ALPSResult)
    assert res.admm_iters == want_iters
    assert torch.equal(res.keep_mask, want_w != 0)
    torch.testing.assert_close(res.weight, want_w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("rho", "seed", "sparsity"), [(2.0, 0, 0.5), (3.0, 1, 0.5), (3.0, 2, 0.8), (100.0, 0, 0.5), (1e7, 1, 0.5)]
)
def test_penalty_schedule_branches_match(rho, seed, sparsity):
    # a large initial rho keeps the first supports nearly fixed: the "no change: rho /= 5" branch, the
    # "small change before any raise: rho /= 5 and restart from B0" branch (seen at iteration 3 for the
    # 2.0 and 3.0 cases) and the 1e6 cap
    weight, gram = layer_problem(32, 64, seed=seed, dtype=torch.float32)
    want_w, want_iters = alps_admm(weight, gram, sparsity, rho=rho)
    res = alps_prune(weight, gram, sparsity=sparsity, rho=rho)
    assert res.admm_iters == want_iters
    assert torch.equal(res.keep_mask, want_w != 0)
    torch.testing.assert_close(res.weight, want_w, rtol=1e-4, atol=1e-5)


def test_short_runs_match_too():
    # max_iter caps the loop, including before the first support check and right after a reset
    weight, gram = problem(seed=3)
    for max_iter in (0, 1, 3, 7):
        want_w, want_iters = alps_admm(weight, gram, 0.6, max_iter=max_iter)
        res = alps_prune(weight, gram, sparsity=0.6, max_iter=max_iter)
        assert res.admm_iters == want_iters == max_iter
        torch.testing.assert_close(res.weight, want_w, rtol=1e-4, atol=1e-5)


def test_cg_matches_original_cg_batch():
    weight, gram = problem(seed=4)
    mask = warmstart_mask(weight, "wanda", sparsity=0.6, gram=gram)
    _, xtx, target, b_orig = _setup(weight, gram, 0.01, torch.float32)
    x0 = b_orig * mask.T
    want = cg_batch(xtx, target, mask.T.float(), X0=x0, rtol=1e-4, maxiter=10)
    out = alps_update(weight, gram, mask, admm_iters=0)
    x_norm = _setup(weight, gram, 0.01, torch.float32)[0]
    torch.testing.assert_close(out, want.t() / x_norm, rtol=1e-5, atol=1e-6)


def test_update_on_a_given_mask_approaches_the_fixed_support_optimum():
    weight, gram = layer_problem(8, 48, seed=5)
    mask = warmstart_mask(weight, "wanda", sparsity=0.6, gram=gram)
    w0, g0, m0 = weight.clone(), gram.clone(), mask.clone()
    out = alps_update(weight, gram, mask, dtype=torch.float64)
    assert torch.equal(weight, w0) and torch.equal(gram, g0) and torch.equal(mask, m0)
    assert not out[~mask].any()
    # the optimum of ALPS's objective (B - B0)^T G' (B - B0) on the support, ridge included in G'
    x_norm, xtx, target, _ = _setup(weight, gram, 0.01, torch.float64)
    best = torch.zeros_like(weight)
    for i in range(8):
        s = mask[i]
        best[i, s] = torch.linalg.solve(xtx[s][:, s], target[s, i]) / x_norm[s]
    torch.testing.assert_close(out, best, rtol=1e-4, atol=1e-4)
    assert loss(weight, gram, out) < float(row_losses(weight, gram, mask).sum())
    bare = alps_update(weight, gram, mask, admm_iters=0, dtype=torch.float64)
    assert loss(weight, gram, bare) < float(row_losses(weight, gram, mask).sum())


@pytest.mark.parametrize(
    "budget",
    [{"sparsity": 0.6}, {"sparsity": 0.6, "scope": "row"}, {"nm": (2, 4)}, {"nm": (1, 4)}, {"nm": (4, 8)}],
)
def test_properties_and_loss_below_wanda(budget):
    weight, gram = problem(d_out=12, d_in=96, seed=6)
    w0, g0 = weight.clone(), gram.clone()
    res = alps_prune(weight, gram, **budget)
    assert torch.equal(weight, w0) and torch.equal(gram, g0)
    assert res.weight.dtype == weight.dtype and res.keep_mask.dtype == torch.bool
    assert not res.weight[~res.keep_mask].any()
    if "nm" in budget:
        n, m = budget["nm"]
        assert (res.keep_mask.reshape(12, -1, m).sum(-1) == n).all()
    elif budget.get("scope") == "row":
        assert (res.keep_mask.sum(1) == 96 - round(0.6 * 96)).all()
    else:
        assert int(res.keep_mask.sum()) == 12 * 96 - round(0.6 * 12 * 96)
    assert 0 < res.admm_iters <= 300
    wanda = warmstart_mask(weight, "wanda", gram=gram, **budget)
    assert loss(weight, gram, res.weight) < float(row_losses(weight, gram, wanda).sum())


def test_uneven_counts_bf16_float64_dead_input_and_empty_budget():
    weight, gram = problem(d_out=7, d_in=50, seed=7)
    gram[3, :] = gram[:, 3] = 0.0  # input 3 never fires
    res = alps_prune(weight.bfloat16(), gram, sparsity=0.37)
    assert res.weight.dtype == torch.bfloat16
    assert int(res.keep_mask.sum()) == 350 - round(0.37 * 350)
    f64 = alps_prune(weight.double(), gram.double(), sparsity=0.37, scope="row", dtype=torch.float64)
    assert f64.weight.dtype == torch.float64 and torch.isfinite(f64.weight).all()
    assert (f64.keep_mask.sum(1) == 50 - round(0.37 * 50)).all()
    with pytest.raises(ValueError, match=r"nm=\(0, 2\) keeps none"):  # an all-zero layer is refused
        alps_prune(weight, gram, nm=(0, 2))


def test_gram_scale_does_not_matter():
    weight, gram = layer_problem(8, 32, seed=8)
    a = alps_prune(weight, gram, sparsity=0.5, dtype=torch.float64)
    b = alps_prune(weight, gram / 4096, sparsity=0.5, dtype=torch.float64)
    assert torch.equal(a.keep_mask, b.keep_mask) and a.admm_iters == b.admm_iters
    torch.testing.assert_close(a.weight, b.weight, rtol=1e-6, atol=1e-8)


def test_bad_inputs_raise():
    weight, gram = problem(d_out=4, d_in=16)
    with pytest.raises(ValueError, match="exactly one of sparsity"):
        alps_prune(weight, gram, sparsity=0.5, nm=(2, 4))
    with pytest.raises(ValueError, match="scope"):
        alps_prune(weight, gram, sparsity=0.5, scope="block")
    with pytest.raises(ValueError, match="rho"):
        alps_prune(weight, gram, sparsity=0.5, rho=-0.1)
    with pytest.raises(ValueError, match="update_iter"):
        alps_prune(weight, gram, sparsity=0.5, update_iter=0)
    with pytest.raises(ValueError, match="cg_rtol"):
        alps_prune(weight, gram, sparsity=0.5, cg_rtol=0.0)
    with pytest.raises(TypeError, match="max_iter"):
        alps_prune(weight, gram, sparsity=0.5, max_iter=None)
    with pytest.raises(TypeError, match="dtype"):
        alps_prune(weight, gram, sparsity=0.5, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="NaN"):
        alps_prune(weight, gram.masked_fill(gram > 1e9, 0).fill_diagonal_(float("nan")), sparsity=0.5)
    with pytest.raises(ValueError, match="sparsity must be in"):
        alps_prune(weight, gram, sparsity=1.0)
    with pytest.raises(TypeError, match="bool"):
        alps_update(weight, gram, torch.ones_like(weight))
    with pytest.raises(ValueError, match="admm_iters"):
        alps_update(weight, gram, torch.ones_like(weight, dtype=torch.bool), admm_iters=-1)
