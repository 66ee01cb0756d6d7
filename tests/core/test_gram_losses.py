import torch

from sparseswaps_prune import GramAccumulator, row_losses
from sparseswaps_prune.core.losses import correlation, swap_delta
from tests.core.reference import layer_problem, row_loss


def test_gram_accumulates_tokens_and_shapes():
    x = torch.randn(3, 5, 8)
    acc = GramAccumulator(8)
    acc.add(x[:2])
    acc.add(x[2].reshape(5, 8))
    flat = x.reshape(-1, 8)
    assert acc.n_tokens == 15
    assert torch.allclose(acc.gram, flat.T @ flat, atol=1e-5)


def test_gram_attention_mask_and_feature_sum():
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    acc = GramAccumulator(6, dtype=torch.float64, track_sum=True)
    acc.add(x, attention_mask=mask)
    kept = x[mask.bool()]
    assert acc.n_tokens == 4
    assert torch.allclose(acc.gram, kept.T @ kept)
    assert torch.allclose(acc.feature_sum, kept.sum(0))


def test_gram_merge_equals_single_pass():
    x = torch.randn(10, 4)
    a, b, whole = GramAccumulator(4, track_sum=True), GramAccumulator(4, track_sum=True), GramAccumulator(4)
    a.add(x[:3])
    b.add(x[3:])
    whole.add(x)
    a.merge(b)
    assert a.n_tokens == 10 and torch.allclose(a.gram, whole.gram, atol=1e-5)
    assert torch.allclose(a.feature_sum, x.sum(0), atol=1e-5)
    empty = GramAccumulator(4).merge(a)
    assert empty.n_tokens == 10 and torch.allclose(empty.gram, a.gram)


def test_row_losses_match_definition():
    weight, gram = layer_problem(5, 12, seed=3)
    keep = torch.rand(5, 12, generator=torch.Generator().manual_seed(0)) > 0.5
    losses = row_losses(weight.float(), gram.float(), keep)
    assert losses.dtype == torch.float64
    for r in range(5):
        assert abs(float(losses[r]) - row_loss(weight[r], gram, keep[r])) <= 1e-4 * max(1.0, float(losses[r]))
    corr = correlation(weight, gram, keep)
    assert torch.allclose(corr, torch.where(keep, 0.0, weight) @ gram)


def test_swap_delta_is_the_exact_change_of_the_loss():
    weight, gram = layer_problem(5, 12, seed=3)
    keep = torch.rand(5, 12, generator=torch.Generator().manual_seed(1)) < 0.5
    keep[:, 0], keep[:, 1] = True, False  # every row has a kept and a pruned input
    corr = correlation(weight, gram, keep)
    rows = torch.arange(5)
    u = torch.stack([torch.nonzero(keep[r]).flatten()[-1] for r in range(5)])
    p = torch.stack([torch.nonzero(~keep[r]).flatten()[-1] for r in range(5)])
    swapped = keep.clone()
    swapped[rows, u], swapped[rows, p] = False, True
    want = [row_loss(weight[r], gram, swapped[r]) - row_loss(weight[r], gram, keep[r]) for r in rows]
    assert torch.allclose(swap_delta(weight, corr, u, p, gram), torch.tensor(want, dtype=torch.float64), rtol=1e-10)
