"""backends.gram_gather: the per-row Gram submatrices equal torch's advanced indexing, entry for entry."""

import pytest
import torch

from sparseswaps_prune.core.backends.gram_gather import gather_gram


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gather_gram_is_advanced_indexing(dtype):
    gen = torch.Generator().manual_seed(0)
    gram = torch.randn(50, 50, generator=gen, dtype=dtype)
    rows = torch.randint(0, 50, (4, 7), generator=gen)
    cols = torch.randint(0, 50, (9, 4), generator=gen).T  # not contiguous
    got = gather_gram(gram.T, rows, cols)  # a transposed (not contiguous) Gram too
    want = gram.T[rows[:, :, None], cols[:, None, :]]
    assert got.dtype == dtype and got.shape == (4, 7, 9) and torch.equal(got, want)
    assert torch.equal(gather_gram(gram, rows[:0], cols[:0]), gram[rows[:0, :, None], cols[:0, None, :]])  # no rows
    tracked = gram.clone().requires_grad_()
    assert torch.equal(gather_gram(tracked, rows, cols), tracked[rows[:, :, None], cols[:, None, :]])
