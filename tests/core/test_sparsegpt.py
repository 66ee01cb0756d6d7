import pytest
import torch

from sparseswaps_prune import row_losses, warmstart_mask
from sparseswaps_prune.core.sparsegpt import SparseGPTResult, sparsegpt_prune
from tests.core.reference import layer_problem, sparsegpt_fasterprune


def update_losses(weight, gram, new_weight):
    """``diag((W - W') G (W - W')^T)`` in float64, ``[d_out]``."""
    d = (weight - new_weight).double()
    return ((d @ gram.double()) * d).sum(dim=1)


def problem_with_dead_input(d_out=8, d_in=64, seed=0, tokens=None):
    weight, gram = layer_problem(d_out, d_in, seed=seed, dtype=torch.float32, tokens=tokens)
    gram[5, :] = gram[:, 5] = 0.0  # input 5 never fires
    return weight, gram


def test_layer_scope_matches_original_fasterprune():
    weight, gram = problem_with_dead_input()
    # the original prunes int(s * numel_block) + 1 per block (its "<=" threshold): 63/128 there = 0.5 here
    want_w, want_pruned = sparsegpt_fasterprune(weight, gram, 63 / 128, blocksize=16)
    res = sparsegpt_prune(weight, gram, sparsity=0.5, blocksize=16)
    assert isinstance(res, SparseGPTResult)
    assert torch.equal(res.keep_mask, ~want_pruned)
    assert torch.equal(res.weight, want_w)  # same float32 operations in the same order
    assert not res.weight[:, 5].any()


@pytest.mark.parametrize(("nm", "prunen"), [((2, 4), 2), ((1, 4), 3), ((6, 8), 2)])
def test_nm_matches_original_fasterprune(nm, prunen):
    weight, gram = problem_with_dead_input(seed=1)
    want_w, want_pruned = sparsegpt_fasterprune(weight, gram, 0.0, prunen, nm[1], blocksize=16)
    res = sparsegpt_prune(weight, gram, nm=nm, blocksize=16)
    assert torch.equal(res.keep_mask, ~want_pruned)
    assert (res.keep_mask.reshape(8, -1, nm[1]).sum(-1) == nm[0]).all()
    assert torch.equal(res.weight, want_w)


@pytest.mark.parametrize("budget", [{"sparsity": 0.5}, {"sparsity": 0.5, "scope": "row"}, {"nm": (2, 4)}])
def test_hessian_scale_does_not_matter(budget):
    # SparseGPT's H = (2 / n) G: same masks and weights up to rounding (float64 here; float32 rounding is
    # amplified by the conditioning of H). Not with dead inputs: their H_ii = 1 enters mean(diag H) unscaled.
    weight, gram = layer_problem(8, 64, seed=2)
    ours = sparsegpt_prune(weight.double(), gram.double(), blocksize=16, dtype=torch.float64, **budget)
    scaled = sparsegpt_prune(weight.double(), 2 / 256 * gram.double(), blocksize=16, dtype=torch.float64, **budget)
    assert torch.equal(ours.keep_mask, scaled.keep_mask)
    torch.testing.assert_close(ours.weight, scaled.weight, rtol=1e-9, atol=1e-9)


def test_counts_layer_row_and_uneven_blocks():
    weight, gram = layer_problem(7, 50, seed=2, dtype=torch.float32)
    layer = sparsegpt_prune(weight, gram, sparsity=0.37, blocksize=16)
    assert int(layer.keep_mask.sum()) == 350 - round(0.37 * 350)
    assert layer.keep_mask.sum(1).unique().numel() > 1  # rows keep unequal counts
    row = sparsegpt_prune(weight, gram, sparsity=0.37, blocksize=16, scope="row")
    assert (row.keep_mask.sum(1) == 50 - round(0.37 * 50)).all()
    for res in (layer, row):
        assert not res.weight[~res.keep_mask].any()
        assert res.weight.dtype == torch.float32
    dense = sparsegpt_prune(weight, gram, sparsity=0.0)
    assert dense.keep_mask.all() and torch.equal(dense.weight, weight)


@pytest.mark.parametrize(
    "budget", [{"sparsity": 0.6, "scope": "row"}, {"sparsity": 0.6, "scope": "layer"}, {"nm": (2, 4)}]
)
def test_error_below_magnitude_and_wanda(budget):
    weight, gram = layer_problem(16, 96, seed=3, dtype=torch.float32)
    res = sparsegpt_prune(weight, gram, blocksize=32, **budget)
    loss = float(update_losses(weight, gram, res.weight).sum())
    for method in ("magnitude", "wanda"):
        mask = warmstart_mask(weight, method, gram=gram, **budget)
        assert int(mask.sum()) == int(res.keep_mask.sum())
        assert loss < float(row_losses(weight, gram, mask).sum())
    mask_only = sparsegpt_prune(weight, gram, blocksize=32, update_weights=False, **budget)
    assert loss < float(row_losses(weight, gram, mask_only.keep_mask).sum())


def test_mask_only_and_dtypes():
    weight, gram = layer_problem(8, 32, seed=4, dtype=torch.float32)
    res = sparsegpt_prune(weight, gram, sparsity=0.5, scope="row", blocksize=8)
    only = sparsegpt_prune(weight, gram, sparsity=0.5, scope="row", blocksize=8, update_weights=False)
    assert torch.equal(only.keep_mask, res.keep_mask)
    assert torch.equal(only.weight, weight * res.keep_mask)
    half = sparsegpt_prune(weight.bfloat16(), gram, sparsity=0.5, update_weights=False)
    assert half.weight.dtype == torch.bfloat16 and torch.equal(half.weight, weight.bfloat16() * half.keep_mask)
    exact = sparsegpt_prune(weight.double(), gram.double(), sparsity=0.5, scope="row", blocksize=8, dtype=torch.float64)
    assert exact.weight.dtype == torch.float64
    assert (exact.keep_mask == res.keep_mask).float().mean() > 0.95
    torch.testing.assert_close(
        update_losses(weight, gram, exact.weight.float()), update_losses(weight, gram, res.weight), rtol=1e-3, atol=0
    )


def test_inputs_not_modified():
    weight, gram = problem_with_dead_input()
    w0, g0 = weight.clone(), gram.clone()
    sparsegpt_prune(weight, gram, sparsity=0.5)
    sparsegpt_prune(weight, gram, nm=(2, 4), update_weights=False)
    assert torch.equal(weight, w0) and torch.equal(gram, g0)


def test_bad_inputs():
    weight, gram = layer_problem(4, 16, seed=5, dtype=torch.float32)
    with pytest.raises(ValueError, match="exactly one"):
        sparsegpt_prune(weight, gram)
    with pytest.raises(ValueError, match="exactly one"):
        sparsegpt_prune(weight, gram, sparsity=0.5, nm=(2, 4))
    with pytest.raises(ValueError, match="scope"):
        sparsegpt_prune(weight, gram, sparsity=0.5, scope="global")
    with pytest.raises(ValueError, match="multiple of m"):
        sparsegpt_prune(weight, gram, nm=(2, 4), blocksize=6)
    with pytest.raises(ValueError, match="blocksize"):
        sparsegpt_prune(weight, gram, sparsity=0.5, blocksize=0)
    with pytest.raises(ValueError, match="damp"):
        sparsegpt_prune(weight, gram, sparsity=0.5, damp=-0.1)
    with pytest.raises(TypeError, match="dtype"):
        sparsegpt_prune(weight, gram, sparsity=0.5, dtype=torch.float16)
    with pytest.raises(ValueError, match="d_in"):
        sparsegpt_prune(weight, gram[:8, :8], sparsity=0.5)
    with pytest.raises(ValueError, match="NaN"):
        sparsegpt_prune(weight.masked_fill(weight > 1, float("nan")), gram, sparsity=0.5)
    indefinite = torch.block_diag(*[torch.tensor([[1.0, 2.0], [2.0, 1.0]])] * 8)
    with pytest.raises(ValueError, match="not positive semi-definite"):
        sparsegpt_prune(weight, indefinite, sparsity=0.5)
    singular = torch.block_diag(*[torch.ones(2, 2)] * 8)  # a valid Gram of rank 8: needs damping
    with pytest.raises(ValueError, match="raise damp"):
        sparsegpt_prune(weight, singular, sparsity=0.5, damp=0.0)


@pytest.mark.parametrize("budget", [{"sparsity": 0.5}, {"sparsity": 0.6, "scope": "row"}, {"nm": (2, 4)}])
def test_fixed_mask_update_reproduces_sparsegpt_and_improves_any_mask(budget):
    weight, gram = problem_with_dead_input(d_in=64, seed=4)
    res = sparsegpt_prune(weight, gram, blocksize=16, **budget)
    again = sparsegpt_prune(weight, gram, blocksize=16, keep_mask=res.keep_mask)
    assert torch.equal(again.keep_mask, res.keep_mask) and torch.equal(again.weight, res.weight)
    wanda = warmstart_mask(weight, "wanda", gram=gram, **{k: v for k, v in budget.items() if k != "scope"})
    updated = sparsegpt_prune(weight, gram, keep_mask=wanda)
    assert torch.equal(updated.keep_mask, wanda) and not updated.weight[~wanda].any()
    assert update_losses(weight, gram, updated.weight).sum() < row_losses(weight, gram, wanda).sum()
