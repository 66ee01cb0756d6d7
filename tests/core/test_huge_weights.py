"""Finite but huge weights (issue 47, item 5): one weight of 1e25 made ALPS return a NaN row (its conjugate gradients
square the normalised weights, which overflows float32), and prune_layer / sparseswaps_unstructured passed the NaN on.
ALPS and ADMM now compute in float64 where float32 could overflow, and prune_layer refuses non-finite stage weights,
naming the layer, the stage and the cause, before anything is written."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sparseswaps_prune.core import alps, stages
from sparseswaps_prune.core.admm import admm_prune, admm_update
from sparseswaps_prune.core.alps import alps_prune, alps_update
from sparseswaps_prune.core.layer import prune_layer
from sparseswaps_prune.core.spec import (
    ADMMStart,
    ALPSStart,
    Budget,
    LeastSquares,
    NoRefine,
    PruneSpec,
    ScoreStart,
    StartWeights,
)
from sparseswaps_prune.prune import sparseswaps_unstructured

ALPS_SPEC = PruneSpec(budget=Budget(sparsity=0.6, scope="layer"), start=ALPSStart(), refine=NoRefine(),
                      weights=StartWeights())  # fmt: skip  # ALPS's mask and weights, the CLI's default recipe's spec


def problem(big: float, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weight [8, 32], the same with weight[3, 5] = big, Gram of 256 tokens)``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(256, 32, generator=gen, dtype=dtype)
    weight = torch.randn(8, 32, generator=gen, dtype=dtype)
    huge = weight.clone()
    huge[3, 5] = big
    return weight, huge, x.T @ x


OTHER_ROWS = [0, 1, 2, 4, 5, 6, 7]


@pytest.mark.parametrize("budget", [{"sparsity": 0.6, "scope": "row"}, {"nm": (2, 4)}])
def test_alps_with_one_huge_weight_is_finite_and_leaves_the_other_rows_alone(budget):
    weight, huge, gram = problem(1e25)
    plain, out = alps_prune(weight, gram, **budget), alps_prune(huge, gram, **budget)
    assert out.weight.dtype == torch.float32 and torch.isfinite(out.weight).all()
    assert out.keep_mask[3, 5] and out.weight[3, 5] == pytest.approx(1e25, rel=1e-6)
    assert torch.equal(out.keep_mask[OTHER_ROWS], plain.keep_mask[OTHER_ROWS])
    # the rows share only ALPS's penalty schedule, which the huge row's support changes shift a little
    torch.testing.assert_close(out.weight[OTHER_ROWS], plain.weight[OTHER_ROWS], atol=1e-2, rtol=0)


def test_alps_layer_wise_with_one_huge_weight_is_finite():
    """The default recipe's budget (60% per layer) gave the NaN row; the huge row now keeps its weights, so the other
    rows share what is left of the layer's budget (they are not compared with the plain run)."""
    _, huge, gram = problem(1e25)
    out = alps_prune(huge, gram, sparsity=0.6)
    assert torch.isfinite(out.weight).all() and out.weight[3, 5] == pytest.approx(1e25, rel=1e-6)
    assert int(out.keep_mask.sum()) == 8 * 32 - round(0.6 * 8 * 32)


def test_alps_update_with_one_huge_weight_is_finite():
    weight, huge, gram = problem(1e25)
    mask = alps_prune(weight, gram, sparsity=0.6, scope="row").keep_mask
    mask[3, 5] = True
    out = alps_update(huge, gram, mask)
    assert torch.isfinite(out).all() and out[3, 5] == pytest.approx(1e25, rel=1e-6)


@pytest.mark.parametrize("big", [1e37, 3e38])
def test_admm_with_a_weight_near_the_float32_maximum_is_finite(big):
    _, huge, gram = problem(big)
    out = admm_prune(huge, gram, sparsity=0.6, scope="row")
    assert torch.isfinite(out.weight).all() and out.keep_mask[3, 5]
    assert torch.isfinite(admm_update(huge, gram, out.keep_mask)).all()


def test_ordinary_weights_stay_in_float32():
    """The float64 fallback is for weights no trained model has: |W| = 10 on inputs of rms 1e3 over 262144 tokens
    at d_in = 14336 is four orders of magnitude short of it."""
    x_norm = torch.full((14336,), 262144**0.5 * 1e3)
    assert not alps._float32_overflows(torch.full((4, 14336), 10.0), x_norm)
    assert alps._float32_overflows(torch.full((4, 14336), 1e25), x_norm)
    weight, _, gram = problem(0.0)
    assert alps._setup(weight, gram, alps.ALPS_DAMP, torch.float32)[1].dtype == torch.float32
    assert alps._setup(problem(1e25)[1], gram, alps.ALPS_DAMP, torch.float32)[1].dtype == torch.float64


@pytest.mark.parametrize("start", [ALPSStart(), ADMMStart()])
def test_prune_layer_with_one_huge_weight_returns_finite_weights(start):
    _, huge, gram = problem(1e25)
    out = prune_layer(huge, gram, PruneSpec(budget=Budget(sparsity=0.6, scope="layer"), start=start,
                                            refine=NoRefine(), weights=StartWeights()))  # fmt: skip
    assert torch.isfinite(out.weight).all() and out.weight[3, 5] == pytest.approx(1e25, rel=1e-6)


def test_prune_layer_names_the_layer_stage_and_cause_of_non_finite_weights():
    """float64 weights of 1e200 overflow even float64 ALPS: a ValueError, not a NaN row."""
    _, huge, gram = problem(1e200, torch.float64)
    with pytest.raises(ValueError) as err:
        prune_layer(huge, gram, ALPS_SPEC, name="model.layers.0.mlp.down_proj")
    assert str(err.value) == (
        "layer model.layers.0.mlp.down_proj: the start stage (alps) returned non-finite weights in 1 of 8 rows "
        "(rows [3]): weights of magnitude up to 1e+200 overflow its arithmetic; rescale or clip them"
    )


def test_prune_layer_names_a_stage_that_breaks_down_on_ordinary_weights(monkeypatch):
    weight, _, gram = problem(0.0)

    def broken(w, *args, **kwargs):
        out = w.clone()
        out[[1, 6]] = float("nan")
        return out

    monkeypatch.setattr(stages, "refit_weights", broken)
    spec = PruneSpec(budget=Budget(sparsity=0.5), start=ScoreStart(), refine=NoRefine(), weights=LeastSquares())
    with pytest.raises(ValueError, match=r"^layer q: the weight stage \(ls\) returned non-finite weights in 2 of 8 "
                                         r"rows \(rows \[1, 6\]\): ls broke down numerically"):  # fmt: skip
        prune_layer(weight, gram, spec, name="q")


def test_sparseswaps_unstructured_leaves_the_module_untouched_on_non_finite_weights():
    _, huge, gram = problem(1e200, torch.float64)
    module = nn.Linear(32, 8, bias=False, dtype=torch.float64)
    with torch.no_grad():
        module.weight.copy_(huge)
    with pytest.raises(ValueError, match=r"non-finite weights.*overflow"):
        sparseswaps_unstructured(module, "weight", 0.6, gram=gram, spec=ALPS_SPEC)
    assert isinstance(module.weight, nn.Parameter) and torch.equal(module.weight, huge)
    assert not hasattr(module, "weight_orig") and not hasattr(module, "weight_mask")
    assert not module._forward_pre_hooks


def test_sparseswaps_unstructured_writes_finite_weights_for_a_huge_float32_weight():
    _, huge, gram = problem(1e25)
    module = nn.Linear(32, 8, bias=False)
    with torch.no_grad():
        module.weight.copy_(huge)
    sparseswaps_unstructured(module, "weight", 0.6, gram=gram, spec=ALPS_SPEC)
    assert torch.isfinite(module.weight).all() and torch.isfinite(module.weight_orig).all()
    assert float(module.weight[3, 5].detach()) == pytest.approx(1e25, rel=1e-6)
