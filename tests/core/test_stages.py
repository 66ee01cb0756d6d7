"""Each stage does its own work behind its role's one method; prune_layer only composes them, so a new stage is one
class (here a toy start and a toy weight stage that the library does not know)."""

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from sparseswaps_prune.core.admm import admm_prune, admm_update
from sparseswaps_prune.core.alps import alps_prune, alps_update
from sparseswaps_prune.core.dsnot import dsnot_refine
from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.core.layer import prune_layer
from sparseswaps_prune.core.losses import row_losses
from sparseswaps_prune.core.refine import refine_mask
from sparseswaps_prune.core.refit import refit_weights
from sparseswaps_prune.core.select import keep_top
from sparseswaps_prune.core.sparsegpt import sparsegpt_prune
from sparseswaps_prune.core.spec import STARTS, WEIGHTS, PruneSpec, build_spec
from sparseswaps_prune.core.stages import (
    ADMMStart,
    ADMMUpdate,
    ALPSStart,
    ALPSUpdate,
    Budget,
    DSnoTRefine,
    KeepWeights,
    LeastSquares,
    NoRefine,
    OBSUpdate,
    ScoreStart,
    SparseGPTStart,
    StageContext,
    StartStage,
    StartWeights,
    SwapRefine,
    WeightStage,
)
from sparseswaps_prune.core.warmstart import warmstart_mask

ROW = Budget(sparsity=0.5)
KEEP = StageContext(KeepWeights())
PUBLISHED = StageContext(StartWeights())


def problem(d_out=6, d_in=16, tokens=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(d_out, d_in, generator=gen)
    acc = GramAccumulator(d_in, track_sum=True)
    acc.add(torch.randn(tokens, d_in, generator=gen) * torch.linspace(0.2, 2.0, d_in))
    return weight, acc


@pytest.mark.parametrize("score", ["magnitude", "wanda", "ria"])
def test_score_start_selects_its_scores_under_the_budget(score):
    weight, acc = problem()
    mask, start_weight = ScoreStart(score).select(weight, acc.gram, ROW, PUBLISHED)
    assert start_weight is None  # a score start computes no weights, whatever the weight stage
    assert torch.equal(mask, warmstart_mask(weight, score, sparsity=0.5, gram=acc.gram))


def test_score_start_prunes_within_a_prior_mask():
    weight, acc = problem()
    prior = warmstart_mask(weight, "magnitude", sparsity=0.25)
    ctx = StageContext(KeepWeights(), prior_mask=prior)
    mask, _ = ScoreStart("wanda").select(torch.where(prior, weight, 0.0), acc.gram, ROW, ctx)
    assert not bool((mask & ~prior).any())
    assert mask.sum(dim=1).tolist() == [6] * 6  # half of each row's 12 remaining weights


@pytest.mark.parametrize(
    ("stage", "run"),
    [
        (SparseGPTStart(), lambda w, g: sparsegpt_prune(w, g, sparsity=0.5, scope="row")),
        (ADMMStart(), lambda w, g: admm_prune(w, g, sparsity=0.5, scope="row")),
        (ALPSStart(), lambda w, g: alps_prune(w, g, sparsity=0.5, scope="row")),
    ],
)
def test_weight_starts_return_their_weights_only_when_asked(stage, run):
    weight, acc = problem()
    want = run(weight, acc.gram)
    mask, start_weight = stage.select(weight, acc.gram, ROW, PUBLISHED)
    assert torch.equal(mask, want.keep_mask) and torch.equal(start_weight, want.weight)
    mask_only, none = stage.select(weight, acc.gram, ROW, KEEP)
    assert torch.equal(mask_only, want.keep_mask) and none is None
    guarded = StageContext(LeastSquares(guard=True))  # the guard falls back to the start's weights
    assert torch.equal(stage.select(weight, acc.gram, ROW, guarded)[1], want.weight)


def test_swap_refine_runs_refine_mask_with_its_fields_and_the_budget():
    weight, acc = problem()
    start = warmstart_mask(weight, "wanda", sparsity=0.5, gram=acc.gram)
    out = SwapRefine(max_iters=5).refine(weight, acc.gram, start, ROW, KEEP)
    want = refine_mask(weight, acc.gram, start, max_iters=5)
    assert torch.equal(out.mask, want.mask) and torch.equal(out.n_swaps, want.n_swaps) and out.iters == want.iters
    assert out.weight is None
    assert torch.equal(out.loss_start, want.loss_before) and torch.equal(out.loss_refined, want.loss_after)
    # the re-fit objective uses the weight stage's ridge and yields its re-fitted weights
    ls = LeastSquares(damp=0.05)
    refit = SwapRefine(max_iters=5, objective="refit").refine(weight, acc.gram, start, ROW, StageContext(ls))
    want = refine_mask(weight, acc.gram, start, max_iters=5, objective="refit", damp=0.05, ridge="diag")
    assert torch.equal(refit.mask, want.mask) and torch.equal(refit.weight, want.weight)


def test_no_refine_and_skipped_dsnot_keep_the_start_mask():
    weight, acc = problem()
    start = warmstart_mask(weight, "wanda", sparsity=0.5, gram=acc.gram)
    loss = row_losses(weight, acc.gram, start)
    ctx = StageContext(KeepWeights(), feature_stats=acc.feature_stats(), name="model.layers.0.mlp.up_proj")
    for stage, context in ((NoRefine(), KEEP), (DSnoTRefine(), ctx)):
        out = stage.refine(weight, acc.gram, start, ROW, context)
        assert out.mask is start and out.iters == 0 and not bool(out.n_swaps.any()) and out.weight is None
        assert torch.equal(out.loss_start, loss) and torch.equal(out.loss_refined, loss)


def test_dsnot_refine_runs_dsnot_on_a_layer_it_does_not_skip():
    weight, acc = problem()
    start = warmstart_mask(weight, "wanda", sparsity=0.5, gram=acc.gram)
    mean, var, sq_mean = acc.feature_stats()
    ctx = StageContext(KeepWeights(), feature_stats=acc.feature_stats(), name="model.layers.0.self_attn.q_proj")
    out = DSnoTRefine().refine(weight, acc.gram, start, ROW, ctx)
    want = dsnot_refine(weight, start, feature_mean=mean, feature_var=var, feature_sq_mean=sq_mean)
    assert torch.equal(out.mask, want.mask) and torch.equal(out.n_swaps, want.n_updates)
    assert torch.equal(out.loss_refined, row_losses(weight, acc.gram, want.mask))


@pytest.mark.parametrize(
    ("stage", "run"),
    [
        (LeastSquares(), lambda w, g, k: refit_weights(w, g, k, damp=0.1, ridge="diag")),
        (LeastSquares(solver="cg"), lambda w, g, k: refit_weights(w, g, k, damp=0.1, ridge="diag", solver="cg")),
        (OBSUpdate(), lambda w, g, k: sparsegpt_prune(w, g, keep_mask=k).weight),
        (ADMMUpdate(), lambda w, g, k: admm_update(w, g, k)),
        (ALPSUpdate(), lambda w, g, k: alps_update(w, g, k)),
    ],
)
def test_weight_updates_fit_the_final_mask(stage, run):
    weight, acc = problem()
    mask = warmstart_mask(weight, "wanda", sparsity=0.5, gram=acc.gram)
    fitted = stage.fit(weight, acc.gram, mask, KEEP)
    assert torch.equal(fitted, run(weight, acc.gram, mask))
    assert stage.updates_weights and not stage.keeps_start_weights


def test_keep_start_and_least_squares_weights_take_what_earlier_stages_computed():
    weight, acc = problem()
    mask = warmstart_mask(weight, "wanda", sparsity=0.5, gram=acc.gram)
    earlier = torch.where(mask, weight, 0.0).double()
    assert KeepWeights().fit(weight, acc.gram, mask, KEEP, start_weight=earlier) is None
    taken = StartWeights().fit(weight, acc.gram, mask, PUBLISHED, start_weight=earlier)
    assert taken.dtype == weight.dtype and torch.equal(taken, earlier.float())
    taken = LeastSquares().fit(weight, acc.gram, mask, KEEP, refined_weight=earlier)
    assert torch.equal(taken, earlier.float())


def test_each_stage_checks_the_spec_it_is_built_into():
    with pytest.raises(ValueError, match=r"weights must be LeastSquares\(solver='direct'\)"):
        PruneSpec(refine=SwapRefine(objective="refit"), weights=LeastSquares(solver="cg"))
    with pytest.raises(ValueError, match="start 'ria' computes none"):
        PruneSpec(start=ScoreStart("ria"), refine=NoRefine(), weights=StartWeights())
    with pytest.raises(ValueError, match=r"the mask is refined \(sparseswaps\)"):
        PruneSpec(start=ALPSStart(), weights=StartWeights())
    with pytest.raises(ValueError, match="blocksize=6 must be a multiple of m=4"):
        PruneSpec(budget=Budget(nm=(2, 4)), start=SparseGPTStart(blocksize=6))


def test_each_stage_checks_the_layers_inputs_before_any_work():
    weight, _ = problem()
    prior = warmstart_mask(weight, "magnitude", sparsity=0.25)
    with pytest.raises(ValueError, match="alps pruning of an already pruned tensor is not supported"):
        ALPSStart().check_inputs(weight, ROW, StageContext(KeepWeights(), prior_mask=prior))
    with pytest.raises(ValueError, match="sparsegpt pruning of an already pruned tensor is not supported"):
        SparseGPTStart().check_inputs(weight, ROW, StageContext(KeepWeights(), prior_mask=prior))
    for start in (ScoreStart(), ADMMStart()):  # they prune again within the prior, not N:M
        with pytest.raises(ValueError, match="N:M pruning of an already pruned tensor"):
            start.check_inputs(weight, Budget(nm=(2, 4)), StageContext(KeepWeights(), prior_mask=prior))
        start.check_inputs(weight, ROW, StageContext(KeepWeights(), prior_mask=prior))
    with pytest.raises(ValueError, match="needs feature_stats"):
        DSnoTRefine().check_inputs(weight, ROW, KEEP)


def test_each_stage_says_why_it_does_not_treat_rows_apart():
    assert ScoreStart("wanda").row_obstacle is None and ScoreStart("ria").row_obstacle.startswith("RIA's scores")
    assert SparseGPTStart().row_obstacle.startswith("the sparsegpt start does not treat rows apart: its float32")
    assert ALPSUpdate().row_obstacle.startswith("the alps weight update does not treat rows apart")
    for stage in (SwapRefine(), DSnoTRefine(), NoRefine(), KeepWeights(), LeastSquares(solver="cg")):
        assert stage.row_obstacle is None
    assert STARTS == ("magnitude", "wanda", "ria", "sparsegpt", "admm", "alps")
    assert WEIGHTS == ("keep", "ls", "cg", "obs", "admm", "alps", "start")


@dataclass(frozen=True)
class StridedStart(StartStage):
    """A toy start the library does not know: every row keeps the inputs ``offset, offset + 2, ...`` (its budget's
    count), and computes weights (its mask's weights halved) for a weight stage that asks."""

    kind: ClassVar[str] = "strided"
    names: ClassVar[tuple[str, ...]] = ("strided",)
    computes_weights: ClassVar[bool] = True
    offset: int = 1

    def select(self, weight, gram, budget, ctx):
        position = torch.arange(weight.shape[1]).expand_as(weight)
        scores = ((position - self.offset) % 2 == 0).float() - position / weight.shape[1] / 2
        keep = keep_top(scores, weight.shape[1] - round(budget.sparsity * weight.shape[1]))
        return keep, torch.where(keep, weight / 2, 0.0) if ctx.weights.wants_start_weights else None


@dataclass(frozen=True)
class Shrink(WeightStage):
    """A toy weight stage: the kept weights times ``factor``."""

    kind: ClassVar[str] = "shrink"
    names: ClassVar[tuple[str, ...]] = ("shrink",)
    factor: float = 0.9
    guard: bool = False

    def fit(self, weight, gram, keep_mask, ctx, *, start_weight=None, refined_weight=None):
        return torch.where(keep_mask, weight * self.factor, 0.0)


def test_a_new_start_plugs_in_without_touching_prune_layer():
    weight, acc = problem()
    strided = torch.zeros_like(weight, dtype=torch.bool)
    strided[:, 1::2] = True
    spec = PruneSpec(budget=ROW, start=StridedStart(), refine=SwapRefine(max_iters=4))
    out = prune_layer(weight, acc.gram, spec)
    assert torch.equal(out.start_mask, strided)
    assert torch.equal(out.n_swaps, refine_mask(weight, acc.gram, strided, max_iters=4).n_swaps)
    assert bool((out.loss.refined <= out.loss.start).all()) and bool((out.loss.refined < out.loss.start).any())
    assert spec.describe() == "50% per row: strided -> sparseswaps T=4 (mask) -> keep"
    assert spec.to_dict()["start"] == {"kind": "strided", "offset": 1}
    # a start that computes weights works with StartWeights and the guard, like the built-in ones
    published = prune_layer(weight, acc.gram, PruneSpec(budget=ROW, start=StridedStart(), refine=NoRefine(),
                                                         weights=StartWeights()))  # fmt: skip
    assert torch.equal(published.weight, torch.where(strided, weight / 2, 0.0))
    with pytest.raises(ValueError, match="unknown start kind 'strided'"):  # JSON knows the built-in stages
        PruneSpec.from_dict(spec.to_dict())


def test_a_new_weight_stage_plugs_in_and_takes_the_guard():
    weight, acc = problem()
    held = torch.randn(40, 16, generator=torch.Generator().manual_seed(3))
    spec = build_spec(sparsity=0.5, max_iters=3, start="wanda")  # a score start: no start weights to fall back to
    out = prune_layer(weight, acc.gram, dataclasses.replace(spec, weights=Shrink()))
    assert torch.equal(out.weight, torch.where(out.keep_mask, weight * 0.9, 0.0))
    guarded = dataclasses.replace(spec, weights=Shrink(factor=3.0, guard=True))
    out = prune_layer(weight, acc.gram, guarded, holdout_gram=held.T @ held)
    assert out.updated_rows == 0.0  # tripling the kept weights never lowers the held-out loss
    assert torch.equal(out.weight, torch.where(out.keep_mask, weight, 0.0))
    assert guarded.describe().endswith("-> shrink (guarded)")


def test_a_spec_refuses_a_stage_of_another_role():
    with pytest.raises(TypeError, match=r"start must be one of ScoreStart.* \(or another StartStage\); got Shrink"):
        PruneSpec(start=Shrink())


def test_the_numerical_functions_default_to_their_stages():
    """Each default lives once: ``refine_mask`` and ``refit_weights`` called with no options do what ``SwapRefine()``
    and ``LeastSquares()`` do in ``prune_layer`` (T=25, the mask objective; least squares with the diag ridge)."""
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(8, 24, generator=gen), torch.randn(24, 96, generator=gen)
    x[2] *= 4
    gram = x @ x.T
    swaps = prune_layer(weight, gram, build_spec(sparsity=0.5, max_iters=SwapRefine().max_iters))
    assert swaps.iters > 0 and swaps.n_swaps.sum() > 0
    assert torch.equal(refine_mask(weight, gram, swaps.start_mask).mask, swaps.keep_mask)
    fitted = prune_layer(weight, gram, build_spec(sparsity=0.5, refine="none", weights="ls"))
    assert LeastSquares().ridge == "diag" and LeastSquares().damp == 0.1
    assert torch.equal(refit_weights(weight, gram, fitted.keep_mask), fitted.weight)
    assert not torch.equal(refit_weights(weight, gram, fitted.keep_mask, ridge="mean"), fitted.weight)
    refit = build_spec(sparsity=0.5, objective="refit", weights="ls")
    both = prune_layer(weight, gram, refit)
    searched = refine_mask(weight, gram, both.start_mask, objective="refit")
    assert torch.equal(searched.mask, both.keep_mask)
    assert torch.allclose(searched.weight.to(both.weight.dtype), both.weight, rtol=1e-6, atol=1e-6)
