import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from sparseswaps_prune import (
    RECIPES,
    GramAccumulator,
    SparseSwapsMethod,
    build_spec,
    prune_layer,
    refine_mask,
    sparseswaps_unstructured,
    warmstart_mask,
)

REFIT = RECIPES["sparseswaps-refit"].spec  # Wanda -> SparseSwaps T=10 -> least-squares re-fit


def model_and_grams(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8))
    accs = [GramAccumulator(16), GramAccumulator(24)]
    hooks = [
        m.register_forward_pre_hook(lambda mod, args, a=a: a.add(args[0]))
        for m, a in zip(model[::2], accs, strict=True)
    ]
    with torch.no_grad():
        model(torch.randn(64, 16))
    for h in hooks:
        h.remove()
    return model, [a.gram for a in accs]


def expected_mask(layer, gram, amount, **kw):
    keep = warmstart_mask(layer.weight.detach(), "wanda", sparsity=amount, gram=gram)
    return refine_mask(layer.weight.detach(), gram, keep, **kw).mask


def test_global_unstructured_prunes_each_layer_row_by_row():
    model, grams = model_and_grams()
    want = [expected_mask(layer, g, 0.6, max_iters=20) for layer, g in zip(model[::2], grams, strict=True)]
    params = [(model[0], "weight"), (model[2], "weight")]
    prune.global_unstructured(
        params,
        pruning_method=SparseSwapsMethod,
        amount=0.6,
        grams=grams,
        shapes=[(24, 16), (8, 24)],
        start="wanda",
        max_iters=20,
        weights="keep",
        spec=REFIT,
    )
    x = torch.randn(5, 16)
    for layer, mask in zip(model[::2], want, strict=True):
        assert prune.is_pruned(layer)
        assert torch.equal(layer.weight_mask.bool(), mask)
        assert (layer.weight_mask.sum(1) == mask.shape[1] - round(0.6 * mask.shape[1])).all()
    w0 = model[0].weight_orig * want[0]
    assert torch.allclose(model[0](x), x @ w0.T + model[0].bias)
    for layer in model[::2]:
        prune.remove(layer, "weight")
        assert not prune.is_pruned(layer)
    assert torch.equal(model[0].weight != 0, want[0])


def test_global_unstructured_with_parameters_on_already_pruned_layers():
    model, grams = model_and_grams(1)
    prune.l1_unstructured(model[0], "weight", amount=0.25)
    before = model[0].weight_mask.bool().clone()
    params = [(model[0], "weight"), (model[2], "weight")]
    method_kwargs = {"amount": 0.5, "grams": grams, "tensors": params, "max_iters": 10, "weights": "keep",
                     "spec": REFIT}  # fmt: skip
    prune.global_unstructured(params, pruning_method=SparseSwapsMethod, **method_kwargs)
    after = model[0].weight_mask.bool()
    assert not (after & ~before).any()  # previously pruned weights stay pruned
    kept_before = before.sum(1)
    assert torch.equal(after.sum(1), kept_before - torch.round(0.5 * kept_before).long())


def test_global_unstructured_without_shapes_is_a_clear_error():
    model, grams = model_and_grams()
    params = [(model[0], "weight"), (model[2], "weight")]
    with pytest.raises(ValueError, match="shapes="):
        prune.global_unstructured(params, pruning_method=SparseSwapsMethod, amount=0.5, grams=grams, weights="keep")
    assert not prune.is_pruned(model)


def test_sparseswaps_unstructured_round_trip_and_results():
    model, grams = model_and_grams(2)
    layer = model[0]
    want = expected_mask(layer, grams[0], 0.5, max_iters=30)
    sparseswaps_unstructured(layer, "weight", amount=0.5, gram=grams[0], max_iters=30, weights="keep", spec=REFIT)
    assert torch.equal(layer.weight_mask.bool(), want)
    x = torch.randn(3, 16)
    assert torch.allclose(layer(x), x @ (layer.weight_orig * want).T + layer.bias)
    prune.remove(layer, "weight")
    assert torch.equal(layer.weight != 0, want)


def test_sparseswaps_unstructured_nm_and_repeat_combination():
    model, grams = model_and_grams(3)
    layer = model[0]
    sparseswaps_unstructured(layer, amount=None, nm=(2, 4), gram=grams[0], start="magnitude", max_iters=10, spec=REFIT)
    assert (layer.weight_mask.reshape(24, 4, 4).sum(-1) == 2).all()
    first = layer.weight_mask.bool().clone()
    sparseswaps_unstructured(layer, amount=0.5, gram=grams[0], max_iters=10, spec=REFIT)
    second = layer.weight_mask.bool()
    assert not (second & ~first).any()
    assert (second.sum(1) == 4).all()


def test_method_refinement_lowers_loss_and_records_results():
    model, grams = model_and_grams(4)
    method = SparseSwapsMethod(0.6, grams=[grams[1]], start="magnitude", max_iters=50, weights="keep", spec=REFIT)
    mask = method.compute_mask(model[2].weight.detach(), torch.ones_like(model[2].weight))
    assert mask.shape == model[2].weight.shape
    (res,) = method.results
    assert res.loss.refined.sum() < res.loss.start.sum()
    assert torch.equal(res.loss.final, res.loss.refined) and res.weight is None


def test_best_recipe_updates_weights_through_apply():
    """``SparseSwapsMethod.apply`` on a dense module (torch has moved the weight to ``weight_orig`` when it asks
    for the mask) runs the recipe's layer spec, ALPS's weights included."""
    best = RECIPES["best"].spec
    model, grams = model_and_grams(6)
    layer = model[0]
    dense = layer.weight.detach().clone()
    SparseSwapsMethod.apply(layer, "weight", 0.5, grams=[grams[0]], tensors=[(layer, "weight")], recipe="best")
    want = prune_layer(dense, grams[0], build_spec(best, sparsity=0.5))
    assert best.updates_weights and want.weight is not None
    assert torch.equal(layer.weight_mask.bool(), want.keep_mask)
    assert torch.equal(layer.weight_orig.detach(), want.weight)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"amount": 1.2}, ValueError, r"sparsity must be in \[0, 1\)"),
        ({"amount": 0.5, "gram": torch.eye(5)}, ValueError, r"Linear\.weight: gram.*\[16, 16\]"),
        ({"amount": 0.5, "gram": torch.full((16, 16), float("nan"))}, ValueError, "NaN"),
        ({"amount": 0.5, "gram": torch.zeros(16, 16)}, ValueError, "no calibration tokens"),
        ({"amount": None, "nm": (3, 5)}, ValueError, "does not divide"),
        ({"amount": 0.5, "nm": (2, 4)}, ValueError, "not both"),
        ({"amount": 0.5, "start": "random"}, ValueError, "start must be one of"),
        ({"amount": 0.5, "refine": "dsnot", "max_iters": 3}, ValueError, "max_iters is an option of refine="),
        ({"amount": 0.5, "weights": "keep", "damp": 0.1}, ValueError, "damp is an option of a weight update"),
    ],
)
def test_bad_input_leaves_module_untouched(kwargs, error, match):
    model, grams = model_and_grams(5)
    layer = model[0]
    weight = layer.weight.detach().clone()
    kwargs = {"gram": grams[0]} | kwargs
    with pytest.raises(error, match=match):
        sparseswaps_unstructured(layer, "weight", **kwargs)
    assert not prune.is_pruned(layer)
    assert torch.equal(layer.weight, weight) and "weight" in layer._parameters


def test_non_2d_weight_rejected():
    conv = nn.Conv2d(2, 3, 3)
    with pytest.raises(ValueError, match="2-D"):
        sparseswaps_unstructured(conv, amount=0.5, gram=torch.eye(18))
    assert not prune.is_pruned(conv)


@pytest.mark.parametrize("route", ["global", "single"])
def test_refit_lands_in_weight_orig(route):
    from sparseswaps_prune import refit_weights, row_losses
    from sparseswaps_prune.core.losses import weight_losses

    model, grams = model_and_grams(3)
    dense = [layer.weight.detach().clone() for layer in model[::2]]
    params = [(model[0], "weight"), (model[2], "weight")]
    if route == "global":
        prune.global_unstructured(
            params,
            pruning_method=SparseSwapsMethod,
            amount=0.5,
            grams=grams,
            tensors=params,
            max_iters=5,
            weights="ls",
            spec=REFIT,
        )
    else:
        for (module, _), gram in zip(params, grams, strict=True):
            sparseswaps_unstructured(module, amount=0.5, gram=gram, max_iters=5, weights="ls", guard=False, spec=REFIT)
    for layer, w, gram in zip(model[::2], dense, grams, strict=True):
        mask = layer.weight_mask.bool()
        assert torch.allclose(layer.weight_orig, refit_weights(w, gram, mask, ridge="diag"), atol=1e-6)
        assert torch.equal(layer.weight, layer.weight_orig * layer.weight_mask) and not layer.weight[~mask].any()
        assert weight_losses(w, layer.weight, gram).sum() < row_losses(w, gram, mask).sum()
    with pytest.raises(ValueError, match="tensors="):
        SparseSwapsMethod(0.5, grams=grams, shapes=[(24, 16), (8, 24)], weights="ls")


def test_refit_objective_and_layer_scope_through_the_prune_method():
    model, grams = model_and_grams(5)
    params = [(model[0], "weight"), (model[2], "weight")]
    dense = [layer.weight.detach().clone() for layer in model[::2]]
    method_kwargs = {"grams": grams, "tensors": params, "max_iters": 5, "scope": "layer"}
    prune.global_unstructured(
        params,
        pruning_method=SparseSwapsMethod,
        amount=0.5,
        objective="refit",
        weights="ls",
        **method_kwargs,
        spec=REFIT,
    )
    for layer, w in zip(model[::2], dense, strict=True):
        assert int(layer.weight_mask.sum()) == w.numel() // 2  # the layer's count, rows may differ
        assert not torch.equal(layer.weight_orig, w)
    with pytest.raises(ValueError, match="weights must be LeastSquares"):
        SparseSwapsMethod(0.5, grams=grams, tensors=params, objective="refit", weights="cg", spec=REFIT)


def test_dsnot_through_the_prune_method_needs_and_uses_feature_stats():
    model, _ = model_and_grams()
    acc = GramAccumulator(16, track_sum=True)
    acc.add(torch.randn(64, 16, generator=torch.Generator().manual_seed(3)))
    params = [(model[0], "weight")]
    with pytest.raises(ValueError, match="feature_stats"):
        SparseSwapsMethod(0.5, grams=[acc.gram], tensors=params, refine="dsnot", weights="keep", spec=REFIT)
    dense = model[0].weight.detach().clone()
    stats = acc.feature_stats()
    spec = build_spec(REFIT, sparsity=0.5, refine="dsnot", weights="keep")
    expected = prune_layer(dense, acc.gram, spec, feature_stats=stats).keep_mask
    sparseswaps_unstructured(
        model[0],
        "weight",
        0.5,
        gram=acc.gram,
        feature_stats=stats,
        refine="dsnot",
        weights="keep",
        spec=REFIT,
    )
    assert torch.equal(model[0].weight_mask.bool(), expected)
