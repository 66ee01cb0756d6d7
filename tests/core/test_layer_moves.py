import numpy as np
import pytest
import torch

from sparseswaps_prune import refine_mask, refit_weights, row_losses, warmstart_mask
from sparseswaps_prune.core import refine
from sparseswaps_prune.core.layer_moves import plan_moves
from sparseswaps_prune.core.refit import REFIT_DAMP
from sparseswaps_prune.core.refit_swaps import refit_objective
from tests.core.reference import brute_layer_step, brute_plan, layer_problem


def layer_loss(objective, weight, gram, keep):
    if objective == "mask":
        return float(row_losses(weight, gram, keep).sum())
    return float(refit_objective(weight, gram, keep, damp=REFIT_DAMP).sum())


@pytest.mark.parametrize("seed", range(40))
def test_plan_moves_is_the_best_combination(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 8))
    swap = rng.normal(size=n) - 0.3
    remove = rng.normal(size=n) + 0.5
    add = rng.normal(size=n) - 0.5
    for values in (swap, remove, add):
        values[rng.random(n) < 0.15] = np.inf  # rows without a swap / nothing kept / nothing restorable
    eps = [0.0, 0.2][seed % 2]
    plan = plan_moves(swap, remove, add, eps)
    swaps, donors, receivers = brute_plan(list(swap), list(remove), list(add), eps)
    assert plan.swap_rows.tolist() == swaps
    assert plan.donor_rows.tolist() == donors
    assert plan.receiver_rows.tolist() == receivers


def test_plan_moves_prefers_a_cross_move_to_two_swaps_only_when_better():
    # rows 0 and 1 can each swap (-1); pruning in row 0 and restoring in row 1 gains 3
    plan = plan_moves(np.array([-1.0, -1.0]), np.array([0.5, 9.0]), np.array([9.0, -3.5]))
    assert (plan.swap_rows.tolist(), plan.donor_rows.tolist(), plan.receiver_rows.tolist()) == ([], [0], [1])
    plan = plan_moves(np.array([-1.0, -1.0]), np.array([0.5, 9.0]), np.array([9.0, -2.0]))
    assert (plan.swap_rows.tolist(), plan.donor_rows.tolist(), plan.receiver_rows.tolist()) == ([0, 1], [], [])
    assert plan_moves(np.array([np.inf]), np.array([1.0]), np.array([-5.0])).empty  # one row: no cross move


@pytest.mark.parametrize("objective", ["mask", "refit"])
@pytest.mark.parametrize(("d_out", "d_in", "seed"), [(4, 8, 0), (4, 6, 1), (5, 6, 2)])
def test_layer_moves_equal_brute_force_step_by_step(objective, d_out, d_in, seed):
    weight, gram = layer_problem(d_out, d_in, seed=seed)
    weight *= torch.tensor([4.0, 0.3, 1.5, 0.5, 2.0][:d_out], dtype=torch.float64)[:, None]  # budget moves pay
    keep = warmstart_mask(weight, "magnitude", sparsity=0.5)
    current = keep
    for _ in range(12):
        expected, plan = brute_layer_step(objective, weight, gram, current)
        res = refine_mask(
            weight, gram, current, max_iters=1, scope="layer", objective=objective, dtype=torch.float64, ridge="mean"
        )
        assert torch.equal(res.mask, expected), plan
        assert int(res.mask.sum()) == int(keep.sum())
        moved = sorted(plan[0] + plan[1] + plan[2])
        assert torch.nonzero(res.n_swaps).flatten().tolist() == moved
        if not moved:
            break
        assert layer_loss(objective, weight, gram, res.mask) < layer_loss(objective, weight, gram, current)
        current = res.mask
    else:
        pytest.fail("did not converge in 12 iterations")
    full = refine_mask(
        weight, gram, keep, max_iters=50, scope="layer", objective=objective, dtype=torch.float64, ridge="mean"
    )
    assert torch.equal(full.mask, current)


@pytest.mark.parametrize("objective", ["mask", "refit"])
@pytest.mark.parametrize("warmstart", ["layer", "sparsegpt-like"])
def test_layer_budget_kept_and_loss_never_rises(objective, warmstart):
    weight, gram = layer_problem(16, 32, seed=5, dtype=torch.float32)
    weight[:4] *= 5  # a few rows matter more
    if warmstart == "layer":
        keep = warmstart_mask(weight, "wanda", sparsity=0.6, gram=gram, scope="layer")
    else:  # arbitrary per-row counts, an empty row and a dense row, as SparseGPT-style masks produce
        scores = torch.rand(16, 32, generator=torch.Generator().manual_seed(0))
        keep = scores < torch.linspace(0.1, 0.8, 16)[:, None]
        keep[3], keep[7] = False, True
    total = int(keep.sum())
    losses = [layer_loss(objective, weight, gram, keep)]
    current = keep
    for _ in range(4):
        res = refine_mask(
            weight, gram, current, max_iters=3, scope="layer", objective=objective, resync_every=2, ridge="mean"
        )
        current = res.mask
        losses.append(layer_loss(objective, weight, gram, current))
        assert int(current.sum()) == total
        assert losses[-1] <= losses[-2]
        before, after = (
            (res.loss_before, res.loss_after) if objective == "mask" else (res.refit_loss_before, res.refit_loss_after)
        )
        assert float(after.sum()) <= float(before.sum()) * (1 + 1e-6)
    assert losses[-1] < 0.9 * losses[0]
    assert not torch.equal(current.sum(1), keep.sum(1))  # the budget moved between rows
    if objective == "refit":
        assert torch.allclose(res.weight, refit_weights(weight, gram, current, ridge="mean"), rtol=1e-4, atol=1e-5)
        assert torch.equal(res.weight != 0, current)


def test_layer_scope_does_at_least_as_well_as_rows_at_first_iteration():
    weight, gram = layer_problem(12, 24, seed=3)
    weight[:3] *= 4
    keep = warmstart_mask(weight, "wanda", sparsity=0.5, gram=gram)
    row = refine_mask(weight, gram, keep, max_iters=1, dtype=torch.float64)
    layer = refine_mask(weight, gram, keep, max_iters=1, scope="layer", dtype=torch.float64)
    assert float(layer.loss_after.sum()) <= float(row.loss_after.sum())


def test_refit_rows_gain_slots_beyond_the_initial_ones():
    weight, gram = layer_problem(4, 16, seed=6)
    weight[0] *= 30  # row 0 takes most of the budget, one weight per iteration
    keep = warmstart_mask(weight, "magnitude", sparsity=0.75)  # 4 kept per row
    res = refine_mask(weight, gram, keep, max_iters=40, scope="layer", objective="refit", resync_every=5, ridge="mean")
    assert int(res.mask[0].sum()) >= 8
    assert int(res.mask.sum()) == 16
    assert torch.allclose(res.weight, refit_weights(weight, gram, res.mask, ridge="mean"), rtol=1e-8, atol=1e-10)
    assert layer_loss("refit", weight, gram, res.mask) < layer_loss("refit", weight, gram, keep)


def test_layer_scope_errors():
    weight, gram = layer_problem(4, 8, seed=1)
    keep = warmstart_mask(weight, "magnitude", nm=(2, 4))
    with pytest.raises(ValueError, match="scope='layer' without nm"):
        refine_mask(weight, gram, keep, nm=(2, 4), scope="layer")
    with pytest.raises(ValueError, match="scope"):
        refine_mask(weight, gram, keep, scope="global")
    singular = gram.clone()
    singular[:, 0] = singular[0, :] = 0.0
    keep = torch.zeros(4, 8, dtype=torch.bool)
    keep[1, :3] = True
    with pytest.raises(ValueError, match=r"singular for rows \[1\].*damp > 0"):
        refine_mask(weight, singular, keep, scope="layer", objective="refit", damp=0.0, ridge="mean")
    bad = weight.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        refine_mask(bad, gram, keep, scope="layer")


def test_refit_layer_state_limit(monkeypatch):
    weight, gram = layer_problem(4, 8, seed=1)
    keep = warmstart_mask(weight, "magnitude", sparsity=0.5)
    monkeypatch.setattr(refine, "LAYER_STATE_BYTES", 1024)
    with pytest.raises(ValueError, match="scope='row'"):
        refine_mask(weight, gram, keep, scope="layer", objective="refit", ridge="mean")
    assert refine_mask(weight, gram, keep, scope="layer").mask.sum() == keep.sum()  # the mask objective is fine
