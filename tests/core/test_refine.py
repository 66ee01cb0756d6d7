import pytest
import torch

from sparseswaps_prune import refine_mask, refit_weights, row_losses, warmstart_mask
from sparseswaps_prune.core.backends import resolve_backend
from sparseswaps_prune.core.refine import Figures, LayerPlanner, MaskRows, RefitRows, RowPlanner, iterate
from sparseswaps_prune.core.refit import damping
from tests.core.reference import brute_layer_step, brute_refine, layer_problem, refit_floor, row_objective

OBJECTIVES = ["mask", "refit"]


def fit_loss(weight, gram, fitted):
    err = (weight - fitted).double()
    return ((err @ gram.double()) * err).sum(1)


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("scope", ["row", "layer"])
def test_result_losses_mean_the_same_for_every_objective(objective, scope):
    weight, gram = layer_problem(10, 24, seed=8, dtype=torch.float32)
    keep = warmstart_mask(weight, "wanda", sparsity=0.5, gram=gram, scope="layer")  # unequal row counts
    res = refine_mask(weight, gram, keep, max_iters=20, objective=objective, scope=scope, ridge="mean")
    assert res.loss_before.dtype == res.loss_after.dtype == torch.float64
    assert torch.allclose(res.loss_before, row_losses(weight, gram, keep), rtol=1e-12)
    assert torch.allclose(res.loss_after, row_losses(weight, gram, res.mask), rtol=1e-12)
    assert res.n_swaps.dtype == torch.long and res.n_swaps.shape == (10,)
    if objective == "mask":
        assert res.weight is None and res.refit_loss_before is None and res.refit_loss_after is None
        assert (res.loss_after.sum() < res.loss_before.sum()) and 0 < res.relative_reduction < 1
        return
    assert res.refit_loss_before.dtype == res.refit_loss_after.dtype == torch.float64
    assert res.refit_loss_before.shape == res.refit_loss_after.shape == (10,)
    assert torch.allclose(
        res.refit_loss_before, fit_loss(weight, gram, refit_weights(weight, gram, keep, ridge="mean")), rtol=1e-5
    )
    assert torch.allclose(res.refit_loss_after, fit_loss(weight, gram, res.weight), rtol=1e-5)
    assert res.refit_loss_after.sum() < res.refit_loss_before.sum()


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_row_scope_with_eps_and_resync_equals_brute_force(objective):
    weight, gram = layer_problem(4, 12, seed=12)
    keep = warmstart_mask(weight, "magnitude", sparsity=0.5)
    loss = row_objective(objective, 0.01)
    eps = 1e-3 * sum(loss(weight[r], gram, keep[r]) for r in range(4)) / 4

    def floor(w_row):
        return eps + (refit_floor(w_row, gram) if objective == "refit" else 0.0)

    ref_mask, history = brute_refine(weight, gram, keep, max_iters=40, loss=loss, floor=floor)
    for resync_every in (1, 2, 32):
        res = refine_mask(
            weight, gram, keep, max_iters=40, eps=eps, objective=objective, damp=0.01, dtype=torch.float64,
            resync_every=resync_every, row_batch=3, ridge="mean",
        )  # fmt: skip
        assert torch.equal(res.mask, ref_mask)
        assert res.n_swaps.tolist() == [len(h) for h in history]
        assert res.iters == max(len(h) for h in history)


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_layer_scope_with_eps_and_resync_equals_brute_force(objective):
    weight, gram = layer_problem(4, 8, seed=3)
    weight *= torch.tensor([3.0, 0.4, 1.5, 0.7], dtype=torch.float64)[:, None]
    keep = warmstart_mask(weight, "magnitude", sparsity=0.5)
    eps = 1e-3 * float(row_losses(weight, gram, keep).mean())
    current, steps = keep, 0
    while True:  # the brute-force layer step, iterated to convergence
        expected, plan = brute_layer_step(objective, weight, gram, current, eps=eps)
        if not any(plan):
            break
        current, steps = expected, steps + 1
    assert steps > 1
    for resync_every in (1, 2, 32):
        res = refine_mask(
            weight, gram, keep, max_iters=50, eps=eps, objective=objective, scope="layer", dtype=torch.float64,
            resync_every=resync_every, row_batch=3, ridge="mean",
        )  # fmt: skip
        assert torch.equal(res.mask, current)
        assert res.iters == steps


def test_iterate_runs_any_model_with_any_planner():
    weight, gram = layer_problem(6, 16, seed=4)
    keep = warmstart_mask(weight, "wanda", sparsity=0.5, gram=gram)
    search = resolve_backend("auto", weight.device, None)
    for scope in ("row", "layer"):
        for objective in OBJECTIVES:
            current = keep.clone()
            if objective == "mask":
                model = MaskRows(weight, current, gram, gram, search=search, nm=None, row_batch=4)
            else:
                lam = damping(gram, 0.01)
                model = RefitRows(weight, current, gram, lam=lam, m=None, row_batch=4, cross=scope == "layer")
            planner = RowPlanner(model.rounding.cpu()) if scope == "row" else LayerPlanner(float(model.rounding.max()))
            n_moves, iters = iterate(model, planner, max_iters=30, resync_every=4)
            want = refine_mask(
                weight, gram, keep, max_iters=30, objective=objective, damp=0.01, scope=scope, dtype=torch.float64,
                resync_every=4, row_batch=4 if scope == "layer" else None, ridge="mean",
            )  # fmt: skip
            assert torch.equal(current, want.mask)  # the model's mask is updated in place
            assert torch.equal(n_moves, want.n_swaps) and iters == want.iters > 0
            if objective == "refit":
                assert torch.allclose(model.fitted(), want.weight, rtol=1e-12, atol=1e-14)
            assert iterate(model, planner, max_iters=0, resync_every=4)[1] == 0


def test_row_planner_retires_rows_that_do_not_improve():
    weight, gram = layer_problem(5, 12, seed=6)
    keep = warmstart_mask(weight, "magnitude", sparsity=0.5)
    res = refine_mask(weight, gram, keep, max_iters=100, dtype=torch.float64)
    # a retired row never moves again: running on from the result moves nothing
    again = refine_mask(weight, gram, res.mask, max_iters=100, dtype=torch.float64)
    assert again.n_swaps.sum() == 0 and again.iters == 0
    assert res.iters == int(res.n_swaps.max())


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_iters": 1.5}, TypeError, "max_iters"),
        ({"max_iters": True}, TypeError, "max_iters"),
        ({"eps": -1.0}, ValueError, "eps"),
        ({"eps": float("nan")}, ValueError, "eps"),
        ({"damp": "0.01"}, TypeError, "damp"),
        ({"resync_every": 0}, ValueError, "resync_every"),
        ({"row_batch": 0}, ValueError, "row_batch"),
        ({"row_batch": 2.0}, TypeError, "row_batch"),
    ],
)
def test_refine_rejects_bad_numbers(kwargs, error, match):
    weight, gram = layer_problem(3, 8, seed=0)
    keep = warmstart_mask(weight, "magnitude", sparsity=0.5)
    with pytest.raises(error, match=match):
        refine_mask(weight, gram, keep, **kwargs)


def test_figures_reach_the_host_bit_for_bit_in_their_dtypes():
    values = torch.tensor([-0.0, float("inf"), float("nan"), 1e-300], dtype=torch.float64)
    handles = torch.tensor([0, 3, 2**62, -1])
    figures = Figures.on_host([values, handles, handles.flip(0)])
    assert figures.swap_dl.dtype == torch.float64 and figures.swap_a.dtype == torch.long
    assert torch.equal(figures.swap_dl.view(torch.long), values.view(torch.long))  # -0.0 and the NaN's bits too
    assert torch.equal(figures.swap_a, handles) and torch.equal(figures.swap_b, handles.flip(0))
    assert figures.remove is None and figures.swap_dl.device.type == "cpu"
    figures.update(torch.tensor([1]), Figures.on_host([values[:1], handles[:1], handles[:1]]))
    assert figures.swap_dl[1] == 0.0 and int(figures.swap_a[1]) == 0 and int(figures.swap_b[1]) == 0
    assert int(figures.swap_a[2]) == 2**62  # the fields are separate
