"""The per-layer seam: prune_layer composes the stages exactly as the stage functions do."""

import dataclasses

import pytest
import torch

from sparseswaps_prune.core.admm import admm_prune, admm_update
from sparseswaps_prune.core.alps import alps_prune, alps_update
from sparseswaps_prune.core.dsnot import dsnot_refine
from sparseswaps_prune.core.gram import GramAccumulator
from sparseswaps_prune.core.layer import LayerOutcome, prune_layer
from sparseswaps_prune.core.losses import row_losses, weight_losses
from sparseswaps_prune.core.refine import refine_mask
from sparseswaps_prune.core.refit import refit_weights
from sparseswaps_prune.core.sparsegpt import sparsegpt_prune
from sparseswaps_prune.core.spec import SPARSESWAPS_SPEC, build_spec
from sparseswaps_prune.core.warmstart import warmstart_mask
from sparseswaps_prune.recipes import RECIPES

REFIT = RECIPES["sparseswaps-refit"].spec  # Wanda -> SparseSwaps T=10 -> least-squares re-fit on G + 0.1 diag(G)


def problem(d_out=12, d_in=32, tokens=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(d_out, d_in, generator=gen)
    acc = GramAccumulator(d_in, track_sum=True)
    acc.add(torch.randn(tokens, d_in, generator=gen) * torch.linspace(0.2, 2.0, d_in))
    held = torch.randn(tokens // 3, d_in, generator=gen) * torch.linspace(0.2, 2.0, d_in)
    return weight, acc, held.T @ held


def test_default_spec_is_sparseswaps_masks_only():
    weight, acc, _ = problem()
    out = prune_layer(torch.nn.Parameter(weight), acc.gram)  # a layer's weight: the outcome carries no graph
    assert not (out.loss.start.requires_grad or out.loss.final.requires_grad)
    start = admm_prune(weight, acc.gram, sparsity=0.6, scope="row").keep_mask
    refined = refine_mask(weight, acc.gram, start, max_iters=25)
    assert SPARSESWAPS_SPEC.refine.max_iters == 25
    assert torch.equal(out.start_mask, start) and torch.equal(out.keep_mask, refined.mask)
    assert out.weight is None and out.updated_rows is None  # masks only: the weights are kept
    assert int(out.n_swaps.sum()) > 0 and torch.equal(out.n_swaps, refined.n_swaps)
    assert torch.equal(out.loss.final, out.loss.refined)
    assert out.loss.refined.sum() < out.loss.start.sum()


def test_best_recipe_spec_is_alps_as_published():
    weight, acc, _ = problem()
    out = prune_layer(torch.nn.Parameter(weight), acc.gram, RECIPES["best"].spec)
    assert not (out.loss.start.requires_grad or out.loss.final.requires_grad or out.weight.requires_grad)
    want = alps_prune(weight, acc.gram, sparsity=0.6, scope="layer")
    assert torch.equal(out.keep_mask, want.keep_mask) and torch.equal(out.weight, want.weight)
    assert torch.equal(out.start_mask, want.keep_mask) and int(out.n_swaps.sum()) == 0
    assert torch.equal(out.loss.final, weight_losses(weight, out.weight, acc.gram))
    assert out.loss.final.sum() < out.loss.start.sum()


def test_refit_recipe_spec_is_start_swaps_then_least_squares():
    weight, acc, _ = problem()
    out = prune_layer(weight, acc.gram, REFIT)
    start = warmstart_mask(weight, "wanda", sparsity=0.6, gram=acc.gram)
    refined = refine_mask(weight, acc.gram, start, max_iters=REFIT.refine.max_iters)
    assert torch.equal(out.start_mask, start) and torch.equal(out.keep_mask, refined.mask)
    fitted = refit_weights(weight, acc.gram, refined.mask, damp=REFIT.weights.damp, ridge="diag")
    assert torch.equal(out.weight, fitted)
    assert torch.equal(out.loss.start, row_losses(weight, acc.gram, start))
    assert torch.equal(out.loss.refined, row_losses(weight, acc.gram, refined.mask))
    assert torch.equal(out.loss.final, weight_losses(weight, out.weight, acc.gram))
    assert out.loss.final.sum() < out.loss.refined.sum() < out.loss.start.sum()
    assert torch.equal(out.n_swaps, refined.n_swaps) and out.iters == refined.iters
    assert out.holdout is None and out.updated_rows == 1.0 and not out.weight[~out.keep_mask].any()


def test_keep_weights_reports_the_mask_losses():
    weight, acc, held = problem(seed=1)
    out = prune_layer(weight, acc.gram, build_spec(REFIT, weights="keep", nm=(2, 4)), holdout_gram=held)
    assert out.weight is None and out.updated_rows is None
    assert torch.equal(out.loss.final, out.loss.refined) and torch.equal(out.holdout.final, out.holdout.refined)
    assert torch.equal(out.holdout.start, row_losses(weight, held, out.start_mask))
    assert (out.keep_mask.reshape(12, -1, 4).sum(-1) == 2).all()


def test_guard_keeps_an_update_only_where_it_lowers_the_held_out_loss():
    weight, acc, held = problem(tokens=40, seed=2)
    spec = build_spec(REFIT, weights="ls", damp=0.0, guard=True)
    unguarded = prune_layer(weight, acc.gram, build_spec(spec, guard=False), holdout_gram=held)
    out = prune_layer(weight, acc.gram, spec, holdout_gram=held)
    better = weight_losses(weight, unguarded.weight, held) < row_losses(weight, held, out.keep_mask)
    assert 0 < int(better.sum()) < 12  # the case exercises both branches
    masked = torch.where(out.keep_mask, weight, 0.0)
    assert torch.equal(out.weight[better], unguarded.weight[better])
    assert torch.equal(out.weight[~better], masked[~better])
    assert out.updated_rows == pytest.approx(float(better.float().mean()))
    assert (out.holdout.final <= out.holdout.refined).all()
    assert (unguarded.holdout.final > unguarded.holdout.refined).any()


def test_refit_objective_yields_its_own_weights():
    weight, acc, _ = problem(seed=3)
    out = prune_layer(weight, acc.gram, build_spec(REFIT, objective="refit", max_iters=5, ridge="mean"))
    searched = refine_mask(weight, acc.gram, out.start_mask, max_iters=5, objective="refit", damp=1e-3, ridge="mean")
    assert torch.equal(out.keep_mask, searched.mask) and torch.equal(out.weight, searched.weight)


def test_guard_falls_back_to_the_starts_weights_where_the_mask_is_the_starts():
    weight, acc, held = problem(tokens=40, seed=1)
    spec = build_spec(REFIT, start="admm", refine="none", weights="ls", ridge="mean", guard=True)
    admm = admm_prune(weight, acc.gram, sparsity=0.6, scope="row")
    unguarded = prune_layer(weight, acc.gram, build_spec(spec, guard=False), holdout_gram=held)
    out = prune_layer(weight, acc.gram, spec, holdout_gram=held)
    assert torch.equal(out.keep_mask, admm.keep_mask)
    better = weight_losses(weight, unguarded.weight, held) < weight_losses(weight, admm.weight, held)
    assert 0 < int(better.sum()) < 12  # both branches
    assert torch.equal(out.weight[better], unguarded.weight[better])
    assert torch.equal(out.weight[~better], admm.weight[~better])
    assert out.updated_rows == pytest.approx(float(better.double().mean()))
    # with refinement, rejecting rows whose mask moved fall back to their original weights on the mask
    swaps = build_spec(spec, refine="sparseswaps", max_iters=3)
    guarded = prune_layer(weight, acc.gram, swaps, holdout_gram=held)
    rejected = (guarded.weight != prune_layer(weight, acc.gram, build_spec(swaps, guard=False)).weight).any(dim=1)
    moved = (guarded.keep_mask != guarded.start_mask).any(dim=1)
    assert (moved & rejected).any() and (~moved & rejected).any()
    masked = torch.where(guarded.keep_mask, weight, 0.0)
    assert torch.equal(guarded.weight[moved & rejected], masked[moved & rejected])
    assert torch.equal(guarded.weight[~moved & rejected], admm.weight[~moved & rejected])


@pytest.mark.parametrize("objective", ["mask", "refit"])
def test_diag_ridge_weights_and_refit_objective(objective):
    weight, acc, _ = problem(seed=5)
    out = prune_layer(weight, acc.gram, build_spec(REFIT, ridge="diag", objective=objective, max_iters=5))
    if objective == "refit":  # swaps judged after the diag-ridge re-fit (refine_mask's ridge="diag")
        searched = refine_mask(weight, acc.gram, out.start_mask, max_iters=5, objective="refit", damp=0.1, ridge="diag")
        assert torch.equal(out.keep_mask, searched.mask) and torch.equal(out.weight, searched.weight)
        assert out.n_swaps.sum() > 0
    fitted = refit_weights(weight, acc.gram, out.keep_mask, ridge="diag")
    assert torch.allclose(out.weight, fitted, rtol=1e-5, atol=1e-6)
    # losses are reported on the calibration Gram itself, not the damped one
    assert torch.equal(out.loss.start, row_losses(weight, acc.gram, out.start_mask))
    assert torch.equal(out.loss.refined, row_losses(weight, acc.gram, out.keep_mask))
    assert torch.equal(out.loss.final, weight_losses(weight, out.weight, acc.gram))


def test_sparsegpt_as_published_and_obs_weights():
    weight, acc, _ = problem(seed=4)
    spec = build_spec(REFIT, start="sparsegpt", scope="layer", refine="none", weights="obs")
    out = prune_layer(weight, acc.gram, spec)
    published = sparsegpt_prune(weight, acc.gram, sparsity=0.6, scope="layer")
    assert torch.equal(out.keep_mask, published.keep_mask)
    assert torch.allclose(out.weight, published.weight, atol=1e-5)
    assert out.n_swaps.sum() == 0 and out.iters == 0


def test_dsnot_needs_feature_stats_and_skips_by_name():
    weight, acc, _ = problem(seed=5)
    spec = build_spec(REFIT, refine="dsnot", weights="keep")
    with pytest.raises(ValueError, match=r"layer q: .*feature_stats"):
        prune_layer(weight, acc.gram, spec, name="q")
    stats = acc.feature_stats(n_samples=4)
    out = prune_layer(weight, acc.gram, spec, feature_stats=stats, name="model.layers.0.self_attn.q_proj")
    mean, var, sq_mean = stats
    want = dsnot_refine(weight, out.start_mask, feature_mean=mean, feature_var=var, feature_sq_mean=sq_mean)
    assert torch.equal(out.keep_mask, want.mask)
    skipped = prune_layer(weight, acc.gram, spec, feature_stats=stats, name="model.layers.0.mlp.up_proj")
    assert torch.equal(skipped.keep_mask, skipped.start_mask)


def test_prior_mask_prunes_the_remaining_weights():
    weight, acc, _ = problem(seed=6)
    prior = torch.rand(12, 32, generator=torch.Generator().manual_seed(0)) > 0.25
    out = prune_layer(weight, acc.gram, build_spec(REFIT, sparsity=0.5), prior_mask=prior)
    assert not (out.keep_mask & ~prior).any()
    kept = prior.sum(1)
    assert torch.equal(out.keep_mask.sum(1), kept - torch.round(0.5 * kept).long())
    default = prune_layer(weight, acc.gram, prior_mask=prior)  # ADMM's start within the prior, then the swaps
    want = admm_prune(torch.where(prior, weight, 0.0), acc.gram, sparsity=0.6, scope="row", prior_mask=prior)
    assert torch.equal(default.start_mask, want.keep_mask)
    assert not (default.keep_mask & ~prior).any()
    assert torch.equal(default.keep_mask.sum(1), kept - torch.round(0.6 * kept).long())
    assert default.loss.refined.sum() < default.loss.start.sum()
    with pytest.raises(ValueError, match="already pruned"):
        prune_layer(weight, acc.gram, build_spec(REFIT, nm=(2, 4)), prior_mask=prior)
    with pytest.raises(ValueError, match="already pruned"):
        prune_layer(weight, acc.gram, build_spec(nm=(2, 4)), prior_mask=prior)
    with pytest.raises(ValueError, match=r"alps pruning of an already pruned tensor.*SPARSESWAPS_SPEC"):
        prune_layer(weight, acc.gram, RECIPES["best"].spec, prior_mask=prior)  # ALPS's start


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"gram": torch.eye(5)}, ValueError, r"layer fc: gram must have shape"),
        ({"spec": {"sparsity": 0.5}}, TypeError, "PruneSpec"),
        ({"holdout_gram": torch.full((32, 32), float("nan"))}, ValueError, "layer fc: holdout_gram contains NaN"),
        ({"spec": build_spec(REFIT, nm=(3, 5))}, ValueError, "does not divide"),
    ],
)
def test_bad_input_names_the_layer(kwargs, error, match):
    weight, acc, _ = problem()
    kwargs = {"gram": acc.gram} | kwargs
    gram = kwargs.pop("gram")
    with pytest.raises(error, match=match):
        prune_layer(weight, gram, name="fc", **kwargs)


@pytest.mark.parametrize("start", ["sparsegpt", "admm", "alps"])
def test_published_methods_keep_their_own_weights(start):
    """``start=<method>, refine="none", weights="start"`` is the method as published; ``weights=<method>`` is its
    update on another mask."""
    weight, acc, _ = problem(seed=7)
    out = prune_layer(weight, acc.gram, build_spec(REFIT, start=start, scope="layer", refine="none", weights="start"))
    if start == "sparsegpt":
        want = sparsegpt_prune(weight, acc.gram, sparsity=0.6, scope="layer")
    else:
        want = (admm_prune if start == "admm" else alps_prune)(weight, acc.gram, sparsity=0.6, scope="layer")
    assert torch.equal(out.keep_mask, want.keep_mask) and torch.equal(out.weight, want.weight)
    assert out.loss.final.sum() < out.loss.refined.sum()
    if start != "sparsegpt":
        spec = build_spec(REFIT, weights=start, guard=False)
        swapped = prune_layer(weight, acc.gram, spec)
        update = (admm_update if start == "admm" else alps_update)(weight, acc.gram, swapped.keep_mask)
        assert torch.equal(swapped.weight, update)


@pytest.mark.parametrize("objective", ["mask", "refit"])
def test_row_swaps_after_a_layer_wise_start(objective):
    weight, acc, _ = problem(seed=7)
    spec = build_spec(REFIT, start="admm", scope="layer", swap_scope="row", objective=objective, max_iters=4)
    out = prune_layer(weight, acc.gram, spec)
    start = admm_prune(weight, acc.gram, sparsity=0.6, scope="layer").keep_mask
    assert torch.equal(out.start_mask, start) and len(set(start.sum(1).tolist())) > 1  # rows keep unequal counts
    fit = {"damp": 0.1, "ridge": "diag"} if objective == "refit" else {}
    refined = refine_mask(weight, acc.gram, start, max_iters=4, objective=objective, scope="row", **fit)
    assert torch.equal(out.keep_mask, refined.mask) and out.n_swaps.sum() > 0
    assert torch.equal(out.keep_mask.sum(1), start.sum(1))  # every row keeps the start's count
    layer_moves = dataclasses.replace(spec, refine=dataclasses.replace(spec.refine, scope=None))
    moved = prune_layer(weight, acc.gram, layer_moves)  # moves between rows: only the layer's total is kept
    assert moved.keep_mask.sum() == start.sum() and not torch.equal(moved.keep_mask.sum(1), start.sum(1))


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"nm": (2, 4), "guard": True, "damp": 0.0}, {"objective": "refit"}, {"refine": "dsnot", "weights": "cg"}],
)
def test_row_slices_of_a_separable_spec_assemble_to_the_layer(kwargs):
    # LayerOutcome.cat of row shards (the distributed pipeline's row_shards), at widths where the BLAS rounds each
    # row's products independently of the number of rows (see llm/distributed.py)
    weight, acc, held = problem(d_out=40, tokens=40, seed=3)
    spec = build_spec(REFIT, **kwargs)
    assert spec.row_separable
    stats = {"feature_stats": acc.feature_stats(n_samples=4), "name": "model.layers.0.self_attn.q_proj"}
    whole = prune_layer(weight, acc.gram, spec, holdout_gram=held, **stats)
    parts = [prune_layer(weight[a:b], acc.gram, spec, holdout_gram=held, **stats) for a, b in ((0, 16), (16, 40))]
    cat = LayerOutcome.cat(parts)
    for field in ("keep_mask", "start_mask", "weight", "n_swaps", "row_updated"):
        assert torch.equal(getattr(cat, field), getattr(whole, field)), field
    for losses in ("loss", "holdout"):
        for stage in ("start", "refined", "final"):
            assert torch.equal(getattr(getattr(cat, losses), stage), getattr(getattr(whole, losses), stage))
    assert cat.iters == whole.iters and cat.updated_rows == whole.updated_rows
    assert cat.seconds_mask == sum(p.seconds_mask for p in parts) and LayerOutcome.cat([whole]) is whole
    if "guard" in kwargs:
        assert 0 < whole.updated_rows < 1 and whole.updated_rows == float(whole.row_updated.double().mean())
