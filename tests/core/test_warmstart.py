import pytest
import torch

from sparseswaps_prune import warmstart_mask
from sparseswaps_prune.core.sparsegpt import sparsegpt_prune
from sparseswaps_prune.core.warmstart import importance_scores
from tests.core.reference import layer_problem


def test_magnitude_per_row_counts_and_choice():
    weight = torch.tensor([[0.1, -3.0, 2.0, 0.5], [4.0, 0.0, -0.2, 1.0]])
    keep = warmstart_mask(weight, "magnitude", sparsity=0.5)
    assert keep.tolist() == [[False, True, True, False], [True, False, False, True]]


def test_wanda_and_ria_scores_match_definitions():
    weight, gram = layer_problem(6, 10, seed=0, dtype=torch.float32)
    norm = torch.diagonal(gram).sqrt()
    assert torch.allclose(importance_scores(weight, "wanda", gram), weight.abs() * norm)
    a = weight.abs()
    ria = (a / a.sum(0, keepdim=True) + a / a.sum(1, keepdim=True)) * norm.sqrt()
    assert torch.allclose(importance_scores(weight, "ria", gram), ria)


@pytest.mark.parametrize("method", ["magnitude", "wanda", "ria"])
def test_layer_scope_and_nm(method):
    weight, gram = layer_problem(8, 16, seed=1, dtype=torch.float32)
    layer = warmstart_mask(weight, method, sparsity=0.75, gram=gram, scope="layer")
    assert int(layer.sum()) == 32
    scores = importance_scores(weight, method, gram)
    assert scores[layer].min() >= scores[~layer].max()
    nm = warmstart_mask(weight, method, nm=(2, 4), gram=gram)
    assert (nm.reshape(8, 4, 4).sum(-1) == 2).all()


def test_ties_are_deterministic_lower_index_kept():
    weight = torch.ones(2, 6)
    keep = warmstart_mask(weight, "magnitude", sparsity=0.5)
    assert keep.tolist() == [[True, True, True, False, False, False]] * 2
    assert warmstart_mask(weight, "magnitude", nm=(1, 3)).tolist() == [[True, False, False, True, False, False]] * 2


def test_zero_sparsity_keeps_all():
    weight, _ = layer_problem(3, 8)
    assert warmstart_mask(weight, "magnitude", sparsity=0.0).all()


def test_wanda_needs_gram():
    with pytest.raises(ValueError, match="Gram"):
        warmstart_mask(torch.randn(4, 8), "wanda", sparsity=0.5)


def test_sparsegpt_warmstart_is_sparsegpts_mask():
    weight, gram = layer_problem(8, 32, seed=2, dtype=torch.float32)
    for kw in ({"sparsity": 0.5, "scope": "row"}, {"sparsity": 0.5, "scope": "layer"}, {"nm": (2, 4)}):
        mask = warmstart_mask(weight, "sparsegpt", gram=gram, **kw)
        assert torch.equal(mask, sparsegpt_prune(weight, gram, **kw).keep_mask)
    with pytest.raises(ValueError, match="Gram"):
        warmstart_mask(weight, "sparsegpt", sparsity=0.5)
