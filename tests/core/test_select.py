"""core/select.py: the partition-based keep_top selects exactly what a stable descending sort selects."""

from __future__ import annotations

import pytest
import torch

from sparseswaps_prune.core.select import keep_top, select_mask


def sorted_keep_top(scores: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """The reference: the ``k`` first entries of a stable descending sort along the last dim (lower index first
    among equal scores)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    position = torch.arange(scores.shape[-1]).expand_as(scores)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, position < k)


def score_cases(gen: torch.Generator) -> list[torch.Tensor]:
    ties = torch.randint(0, 4, (3, 40), generator=gen).float()  # many ties at every threshold
    signed_zeros = torch.randint(-1, 2, (2, 33), generator=gen).float() * 0.0  # -0.0 and 0.0 are equal
    infinities = torch.randn(4, 50, generator=gen, dtype=torch.float64)
    infinities[:, ::3], infinities[:, 1::7] = float("inf"), -float("inf")
    return [
        torch.randn(5, 37, generator=gen),
        ties,
        signed_zeros,
        infinities,
        ties.T.contiguous().T,  # not contiguous
        torch.randn(4, 6, 4, generator=gen),  # N:M blocks
        torch.randn(1, 1, generator=gen),
    ]


@pytest.mark.parametrize("case", range(7))
def test_keep_top_equals_the_stable_sort(case):
    scores = score_cases(torch.Generator().manual_seed(case))[case]
    n = scores.shape[-1]
    for k in sorted({0, 1, n // 3, n // 2, n - 1, n, n + 2}):
        got = keep_top(scores, k)
        assert got.dtype == torch.bool and got.shape == scores.shape
        assert torch.equal(got, sorted_keep_top(scores, k)), k
        assert torch.equal(got.sum(-1), torch.full(scores.shape[:-1], max(0, min(k, n))))


def test_keep_top_sort_paths_agree():
    """Per-row counts, NaN scores and bfloat16 take the sort; the result is the reference's."""
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 3, (4, 20), generator=gen).float()
    counts = torch.tensor([[0], [3], [7], [20]])
    assert torch.equal(keep_top(scores, counts), sorted_keep_top(scores, counts))
    with_nan = scores.clone()
    with_nan[1, 4] = float("nan")
    assert torch.equal(keep_top(with_nan, 5), sorted_keep_top(with_nan, 5))
    half = scores.bfloat16()
    assert torch.equal(keep_top(half, 6), sorted_keep_top(half, 6))


def test_select_mask_layer_budget_keeps_the_lowest_index_among_ties():
    scores = torch.ones(3, 4)
    keep = select_mask(scores, sparsity=0.5, scope="layer")
    assert keep.flatten().tolist() == [True] * 6 + [False] * 6
