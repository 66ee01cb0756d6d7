import pytest
import torch

from sparseswaps_prune import row_losses, warmstart_mask
from sparseswaps_prune.core.admm import ADMMResult, admm_prune, admm_update
from sparseswaps_prune.core.losses import weight_losses
from tests.core.reference import layer_problem
from tests.core.reference_admm_alps import admm_fasterprune, admm_fixed_mask, admm_per_out_within


def problem(d_out=16, d_in=64, seed=0):
    return layer_problem(d_out, d_in, seed=seed, dtype=torch.float32)


def loss(weight, gram, new_weight):
    return float(weight_losses(weight, new_weight, gram).sum())


@pytest.mark.parametrize(
    ("budget", "original"),
    [
        ({"sparsity": 0.5}, {"sparsity": 0.5}),
        ({"sparsity": 0.75}, {"sparsity": 0.75}),
        ({"sparsity": 0.5, "scope": "row"}, {"sparsity": 0.5, "per_out": True}),
        ({"sparsity": 0.625, "scope": "row"}, {"sparsity": 0.625, "per_out": True}),
        ({"nm": (2, 4)}, {"sparsity": 0.5, "prune_n": 2, "prune_m": 4}),
    ],
)
@pytest.mark.parametrize("reselect_iters", [15, 0])
def test_matches_original_fasterprune(budget, original, reselect_iters):
    weight, gram = problem(seed=1)
    want_w, want_keep = admm_fasterprune(weight, gram, iterative_prune=reselect_iters, **original)
    res = admm_prune(weight, gram, reselect_iters=reselect_iters, **budget)
    assert isinstance(res, ADMMResult)
    assert torch.equal(res.keep_mask, want_keep)
    torch.testing.assert_close(res.weight, want_w, rtol=1e-4, atol=1e-5)


def test_iters_zero_is_the_wanda_mask_with_original_weights():
    weight, gram = problem(seed=2)
    res = admm_prune(weight, gram, sparsity=0.5, iters=0, reselect_iters=0)
    want_w, want_keep = admm_fasterprune(weight, gram, 0.5, iterative_prune=0, iters=0)
    assert torch.equal(res.keep_mask, want_keep)
    assert torch.equal(res.keep_mask, warmstart_mask(weight, "wanda", sparsity=0.5, gram=gram, scope="layer"))
    torch.testing.assert_close(res.weight, want_w)
    torch.testing.assert_close(res.weight, weight * res.keep_mask)


def test_update_matches_original_on_a_given_mask():
    weight, gram = problem(seed=3)
    mask = warmstart_mask(weight, "wanda", sparsity=0.6, gram=gram)
    out = admm_update(weight, gram, mask)
    torch.testing.assert_close(out, admm_fixed_mask(weight, gram, mask), rtol=1e-4, atol=1e-5)
    assert not out[~mask].any()
    assert loss(weight, gram, out) < float(row_losses(weight, gram, mask).sum())
    torch.testing.assert_close(admm_update(weight, gram, mask, iters=0), weight * mask)  # (w * n) / n


def test_update_of_its_own_mask_with_reselect_zero_is_admm_prune():
    weight, gram = problem(seed=4)
    res = admm_prune(weight, gram, sparsity=0.5, reselect_iters=0)
    torch.testing.assert_close(admm_update(weight, gram, res.keep_mask), res.weight)


@pytest.mark.parametrize(
    "budget",
    [{"sparsity": 0.6}, {"sparsity": 0.6, "scope": "row"}, {"nm": (2, 4)}, {"nm": (1, 4)}, {"nm": (4, 8)}],
)
def test_properties_and_loss_below_wanda(budget):
    weight, gram = problem(d_out=12, d_in=96, seed=5)
    w0, g0 = weight.clone(), gram.clone()
    res = admm_prune(weight, gram, **budget)
    assert torch.equal(weight, w0) and torch.equal(gram, g0)  # inputs not modified
    assert res.weight.dtype == weight.dtype and res.keep_mask.dtype == torch.bool
    assert not res.weight[~res.keep_mask].any()
    if "nm" in budget:
        n, m = budget["nm"]
        assert (res.keep_mask.reshape(12, -1, m).sum(-1) == n).all()
    elif budget.get("scope") == "row":
        assert (res.keep_mask.sum(1) == 96 - round(0.6 * 96)).all()
    else:
        assert int(res.keep_mask.sum()) == 12 * 96 - round(0.6 * 12 * 96)
    wanda = warmstart_mask(weight, "wanda", gram=gram, **budget)
    assert loss(weight, gram, res.weight) < float(row_losses(weight, gram, wanda).sum())


def test_uneven_counts_bf16_float64_and_dead_input():
    weight, gram = problem(d_out=7, d_in=50, seed=6)
    gram[3, :] = gram[:, 3] = 0.0  # input 3 never fires
    res = admm_prune(weight.bfloat16(), gram, sparsity=0.37, scope="row")
    assert res.weight.dtype == torch.bfloat16
    assert (res.keep_mask.sum(1) == 50 - round(0.37 * 50)).all()
    layer = admm_prune(weight, gram, sparsity=0.37)
    assert int(layer.keep_mask.sum()) == 350 - round(0.37 * 350)
    assert torch.isfinite(layer.weight).all()
    f64 = admm_prune(weight.double(), gram.double(), sparsity=0.37, dtype=torch.float64)
    assert f64.weight.dtype == torch.float64 and torch.isfinite(f64.weight).all()


def test_gram_scale_does_not_matter():
    weight, gram = layer_problem(8, 32, seed=7)
    a = admm_prune(weight, gram, sparsity=0.5, dtype=torch.float64)
    b = admm_prune(weight, gram / 4096, sparsity=0.5, dtype=torch.float64)
    assert torch.equal(a.keep_mask, b.keep_mask)
    torch.testing.assert_close(a.weight, b.weight, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("sparsity", [0.5, 0.6])
def test_prior_mask_matches_the_per_row_oracle_within_it(sparsity):
    weight, gram = problem(d_out=12, d_in=48, seed=8)
    prior = torch.rand(12, 48, generator=torch.Generator().manual_seed(1)) > 0.3
    given = torch.where(prior, weight, 0.0).double()
    res = admm_prune(given, gram.double(), sparsity=sparsity, scope="row", dtype=torch.float64, prior_mask=prior)
    want_w, want_keep = admm_per_out_within(weight, gram, sparsity, prior)
    assert torch.equal(res.keep_mask, want_keep)
    torch.testing.assert_close(res.weight, want_w, rtol=1e-9, atol=1e-11)
    kept = prior.sum(1)
    assert not (res.keep_mask & ~prior).any()
    assert torch.equal(res.keep_mask.sum(1), kept - torch.round(sparsity * kept).long())
    layer = admm_prune(given, gram.double(), sparsity=sparsity, dtype=torch.float64, prior_mask=prior)
    assert torch.equal(layer.keep_mask, res.keep_mask)  # within a prior, rows count apart whatever the scope


def test_all_true_prior_mask_is_no_prior_and_nm_refuses_one():
    weight, gram = problem(seed=9)
    every = torch.ones_like(weight, dtype=torch.bool)
    for reselect_iters in (15, 0):
        a = admm_prune(weight, gram, sparsity=0.6, scope="row", reselect_iters=reselect_iters)
        b = admm_prune(weight, gram, sparsity=0.6, scope="row", reselect_iters=reselect_iters, prior_mask=every)
        assert torch.equal(a.keep_mask, b.keep_mask) and torch.equal(a.weight, b.weight)
    with pytest.raises(ValueError, match="N:M pruning of an already pruned tensor"):
        admm_prune(weight, gram, nm=(2, 4), prior_mask=every)
    with pytest.raises(TypeError, match="prior_mask must be a bool"):
        admm_prune(weight, gram, sparsity=0.5, prior_mask=every.float())


def test_bad_inputs_raise():
    weight, gram = problem(d_out=4, d_in=16)
    with pytest.raises(ValueError, match="exactly one of sparsity"):
        admm_prune(weight, gram)
    with pytest.raises(ValueError, match="scope"):
        admm_prune(weight, gram, sparsity=0.5, scope="block")
    with pytest.raises(ValueError, match="reselect_iters"):
        admm_prune(weight, gram, sparsity=0.5, iters=10)
    with pytest.raises(ValueError, match="rho"):
        admm_prune(weight, gram, sparsity=0.5, rho=0.0)
    with pytest.raises(ValueError, match="damp"):
        admm_prune(weight, gram, sparsity=0.5, damp=-1.0)
    with pytest.raises(TypeError, match="iters"):
        admm_prune(weight, gram, sparsity=0.5, iters=2.5)
    with pytest.raises(TypeError, match="dtype"):
        admm_prune(weight, gram, sparsity=0.5, dtype=torch.float16)
    with pytest.raises(ValueError, match="shape"):
        admm_prune(weight, gram[:8, :8], sparsity=0.5)
    with pytest.raises(ValueError, match="all zeros"):
        admm_prune(weight, torch.zeros_like(gram), sparsity=0.5)
    with pytest.raises(ValueError, match="divide"):
        admm_prune(weight, gram, nm=(2, 5))
    with pytest.raises(TypeError, match="bool"):
        admm_update(weight, gram, torch.ones_like(weight))
    with pytest.raises(ValueError, match="shape"):
        admm_update(weight, gram, torch.ones(4, 8, dtype=torch.bool))
