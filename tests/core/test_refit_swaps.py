from dataclasses import fields

import pytest
import torch

from sparseswaps_prune import refine_mask, refit_weights, row_losses, warmstart_mask
from sparseswaps_prune.core import refit_swaps as rs
from sparseswaps_prune.core.backends import refit_state
from sparseswaps_prune.core.refine import RefitRows
from sparseswaps_prune.core.refit import damping
from tests.core.reference import (
    brute_best_swap_of,
    brute_refine_refit,
    layer_problem,
    refit_row_objective,
    row_objective,
)


def state_of(weight, gram, keep, damp):
    counts = keep.sum(1)
    lam = damping(gram, damp)
    k, q = int(counts.max()), int((keep.shape[1] - counts).max())
    return rs.build_state(weight, keep, gram, lam, k, q), lam


def fit_loss(weight, gram, fitted):
    err = (weight - fitted).double()
    return ((err @ gram.double()) * err).sum(1)


@pytest.mark.parametrize("damp", [0.0, 0.05])
def test_delta_formulas_match_recomputation(damp):
    weight, gram = layer_problem(3, 10, seed=4)
    keep = warmstart_mask(weight, "magnitude", sparsity=0.5)
    state, _ = state_of(weight, gram, keep, damp)
    assert torch.allclose(rs.refit_objective(weight, gram, keep, damp=damp), torch.tensor(
        [refit_row_objective(weight[r], gram, keep[r], damp) for r in range(3)], dtype=torch.float64
    ))  # fmt: skip
    h = torch.diagonal(state.inv, dim1=1, dim2=2)
    for r in range(3):
        base = refit_row_objective(weight[r], gram, keep[r], damp)
        for i in range(state.kept.shape[1]):
            u = int(state.kept[r, i])
            v_u, h_uu = state.coef[r, i], h[r, i]
            trial = keep[r].clone()
            trial[u] = False
            assert float(v_u**2 / h_uu) == pytest.approx(refit_row_objective(weight[r], gram, trial, damp) - base)
            for j in range(state.pruned.shape[1]):
                p = int(state.pruned[r, j])
                z = state.z[r, i, j]
                dl = v_u**2 / h_uu - (state.resid[r, j] + z * v_u / h_uu) ** 2 / (state.schur[r, j] + z**2 / h_uu)
                trial = keep[r].clone()
                trial[u], trial[p] = False, True
                want = refit_row_objective(weight[r], gram, trial, damp) - base
                assert float(dl) == pytest.approx(want, rel=1e-9, abs=1e-9 * abs(base))
        for j in range(state.pruned.shape[1]):
            p = int(state.pruned[r, j])
            trial = keep[r].clone()
            trial[p] = True
            want = refit_row_objective(weight[r], gram, trial, damp) - base
            assert float(-(state.resid[r, j] ** 2) / state.schur[r, j]) == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize(("nm", "sparsity"), [(None, 0.5), (None, 0.7), ((2, 4), None)])
def test_scan_matches_brute_force(nm, sparsity):
    weight, gram = layer_problem(5, 16, seed=2)
    keep = warmstart_mask(weight, "wanda", sparsity=sparsity, nm=nm, gram=gram)
    state, lam = state_of(weight, gram, keep, 0.01)
    m = nm[1] if nm else None
    dl, slot_i, slot_j = rs.scan_swaps(state, weight, torch.arange(5), rs.pivot_floor(gram, lam), m)
    loss = row_objective("refit", 0.01)
    for r in range(5):
        ref_dl, ref_u, ref_p = brute_best_swap_of(loss, weight[r], gram, keep[r], m)
        assert (int(state.kept[r, slot_i[r]]), int(state.pruned[r, slot_j[r]])) == (ref_u, ref_p)
        assert float(dl[r]) == pytest.approx(ref_dl, rel=1e-9)


@pytest.mark.parametrize(
    ("d_out", "d_in", "sparsity", "damp"), [(4, 12, 0.5, 0.01), (3, 14, 0.7, 0.0), (3, 10, 0.3, 0.2)]
)
def test_refine_refit_equals_brute_force_swap_for_swap(d_out, d_in, sparsity, damp):
    weight, gram = layer_problem(d_out, d_in, seed=d_in)
    keep = warmstart_mask(weight, "magnitude", sparsity=sparsity)
    ref_mask, history = brute_refine_refit(weight, gram, keep, damp, max_iters=40)
    res = refine_mask(weight, gram, keep, max_iters=40, objective="refit", damp=damp, ridge="mean")
    assert torch.equal(res.mask, ref_mask)
    assert res.n_swaps.tolist() == [len(h) for h in history]
    assert res.iters == max(len(h) for h in history)
    current = keep
    for step in range(res.iters):
        current = refine_mask(weight, gram, current, max_iters=1, objective="refit", damp=damp, ridge="mean").mask
        for r, h in enumerate(history):
            if step < len(h):
                u, p = h[step]
                assert not current[r, u] and current[r, p]


def test_refine_refit_nm_equals_brute_force():
    weight, gram = layer_problem(4, 16, seed=7)
    keep = warmstart_mask(weight, "magnitude", nm=(2, 4))
    ref_mask, history = brute_refine_refit(weight, gram, keep, 0.01, max_iters=20, m=4)
    res = refine_mask(weight, gram, keep, max_iters=20, nm=(2, 4), objective="refit", damp=0.01, ridge="mean")
    assert torch.equal(res.mask, ref_mask)
    assert res.n_swaps.tolist() == [len(h) for h in history]
    assert (res.mask.reshape(4, -1, 4).sum(-1) == 2).all()


def test_objective_never_rises_and_weights_are_the_refit():
    weight, gram = layer_problem(12, 40, seed=11, dtype=torch.float32)
    keep = warmstart_mask(weight, "wanda", sparsity=0.6, gram=gram)
    objective = [rs.refit_objective(weight, gram, keep)]
    for _ in range(5):
        res = refine_mask(weight, gram, keep, max_iters=1, objective="refit", ridge="mean")
        keep = res.mask
        objective.append(rs.refit_objective(weight, gram, keep))
        assert (objective[-1] <= objective[-2]).all()
        assert (keep.sum(1) == 16).all()
        assert res.weight.dtype == torch.float32
        assert torch.equal(res.weight != 0, keep)
        assert torch.allclose(res.weight, refit_weights(weight, gram, keep, ridge="mean"), rtol=1e-5, atol=1e-6)
    assert objective[-1].sum() < 0.8 * objective[0].sum()
    full = refine_mask(
        weight, gram, warmstart_mask(weight, "wanda", sparsity=0.6, gram=gram), objective="refit", ridge="mean"
    )
    refit_loss = fit_loss(weight, gram, refit_weights(weight, gram, full.mask, ridge="mean"))
    assert torch.allclose(full.refit_loss_after, refit_loss, rtol=1e-4)
    assert 1 - float(full.refit_loss_after.sum()) / float(full.refit_loss_before.sum()) > 0.2
    assert torch.allclose(full.loss_after, row_losses(weight, gram, full.mask), rtol=1e-12)  # the mask loss
    # the re-fit objective finds masks the mask-only objective does not: compare after re-fitting both
    mask_only = refine_mask(weight, gram, warmstart_mask(weight, "wanda", sparsity=0.6, gram=gram)).mask
    assert rs.refit_objective(weight, gram, full.mask).sum() < rs.refit_objective(weight, gram, mask_only).sum()


def test_diag_ridge_searches_the_damped_gram_and_reports_losses_on_g():
    weight, gram = layer_problem(10, 32, seed=4, dtype=torch.float32)
    keep = warmstart_mask(weight, "wanda", sparsity=0.6, gram=gram)
    res = refine_mask(weight, gram, keep, max_iters=8, objective="refit", damp=0.1, ridge="diag")
    gram64 = gram.double()
    damped = gram64 + torch.diag(0.1 * torch.diagonal(gram64))  # least squares on G + 0.1 diag(G), no ridge
    plain = refine_mask(weight, damped, keep, max_iters=8, objective="refit", damp=0.0, ridge="mean")
    assert torch.equal(res.mask, plain.mask) and torch.equal(res.weight, plain.weight)
    assert res.n_swaps.sum() > 0 and not torch.equal(res.mask, keep)
    assert torch.allclose(
        res.weight, refit_weights(weight, gram, res.mask, damp=0.1, ridge="diag"), rtol=1e-5, atol=1e-6
    )
    # every loss is on G itself: the mask losses and the re-fitted weights' losses
    assert torch.allclose(res.loss_before, row_losses(weight, gram, keep), rtol=1e-12)
    assert torch.allclose(res.loss_after, row_losses(weight, gram, res.mask), rtol=1e-12)
    assert torch.allclose(res.refit_loss_after, fit_loss(weight, gram, res.weight), rtol=1e-5)
    assert not torch.allclose(res.refit_loss_after, fit_loss(weight, damped, res.weight), rtol=1e-3)
    with pytest.raises(ValueError, match="ridge must be"):
        refine_mask(weight, gram, keep, objective="refit", ridge="full")


def test_state_updates_match_a_rebuild():
    weight, gram = layer_problem(3, 20, seed=5)
    keep = warmstart_mask(weight, "magnitude", sparsity=0.6)
    state, lam = state_of(weight, gram, keep, 0.01)
    rows = torch.arange(3)
    for _ in range(6):  # six swaps per row by low-rank updates only
        _, slot_i, slot_j = rs.scan_swaps(state, weight, rows, rs.pivot_floor(gram, lam))
        rs.swap_slots(state, rows, slot_i, slot_j, gram)
    fresh = rs.build_state(weight, rs.keep_of(state, 20), gram, lam, 8, 12)
    assert torch.allclose(rs.fitted_weights(state, 20), rs.fitted_weights(fresh, 20), rtol=1e-10, atol=1e-12)
    for r in range(3):  # compare by input index (slot orders differ)
        ki, pi = state.kept[r].argsort(), state.pruned[r].argsort()
        fi, fp = fresh.kept[r].argsort(), fresh.pruned[r].argsort()
        assert torch.equal(state.kept[r, ki], fresh.kept[r, fi])
        assert torch.allclose(state.inv[r][ki][:, ki], fresh.inv[r][fi][:, fi], rtol=1e-9, atol=1e-12)
        assert torch.allclose(state.z[r][ki][:, pi], fresh.z[r][fi][:, fp], rtol=1e-9, atol=1e-12)
        assert torch.allclose(state.resid[r, pi], fresh.resid[r, fp], rtol=1e-9, atol=1e-9)
        assert torch.allclose(state.schur[r, pi], fresh.schur[r, fp], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dim", [1, 2])
def test_product_sums_are_the_batched_products_sums_bit_for_bit(dim):
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randn(4, 37, 53, generator=gen, dtype=torch.float64) for _ in range(2))
    assert torch.equal(refit_state._product_sums(a, b, dim), (a * b).sum(dim=dim))


@pytest.mark.parametrize("transposed", [False, True])
def test_the_build_writes_z_into_a_given_buffer_bit_for_bit(transposed):
    weight, gram = layer_problem(5, 30, seed=8)
    keep = warmstart_mask(weight, "wanda", gram=gram, sparsity=0.6)
    lam, (k, q) = damping(gram, 0.01), (12, 18)
    want = rs.build_state(weight, keep, gram, lam, k, q, transposed_z=transposed)
    buffer = torch.full((5, q, k) if transposed else (5, k, q), float("nan"), dtype=torch.float64)
    got = rs.build_state(weight, keep, gram, lam, k, q, transposed_z=transposed, z_out=buffer)
    assert torch.equal(got.z, want.z) and got.z.data_ptr() == buffer.data_ptr()
    assert torch.equal(got.schur, want.schur) and torch.equal(got.resid, want.resid)


def test_swaps_read_h_only_on_and_above_its_diagonal():
    weight, gram = layer_problem(4, 24, seed=6)
    keep = warmstart_mask(weight, "wanda", gram=gram, sparsity=0.5)
    state, lam = state_of(weight, gram, keep, 0.01)
    stale = rs.RefitState(*(t.clone() for t in vars(state).values()))
    below = torch.ones_like(state.inv[0], dtype=torch.bool).tril(-1)
    stale.inv[:, below] = float("nan")  # never read
    rows, floor = torch.arange(4), rs.pivot_floor(gram, lam)
    slot = torch.tensor([0, 3, 5, 11])
    assert torch.equal(rs.inv_column(stale, rows, slot), state.inv[rows, :, slot])  # H is symmetric when built
    for _ in range(4):
        _, slot_i, slot_j = rs.scan_swaps(state, weight, rows, floor)
        rs.swap_slots(state, rows, slot_i, slot_j, gram)
        rs.swap_slots(stale, rows, slot_i, slot_j, gram)
    for name, value in vars(state).items():  # H on and above its diagonal: all that is read
        assert torch.equal(getattr(stale, name).triu() if name == "inv" else getattr(stale, name),
                           value.triu() if name == "inv" else value), name  # fmt: skip
    assert not torch.equal(stale.inv, state.inv)


def test_every_build_variant_gives_the_same_state():
    weight, gram = layer_problem(6, 24, seed=3)
    keep = warmstart_mask(weight, "wanda", sparsity=0.6, gram=gram, scope="layer")  # unequal row counts
    counts = keep.sum(1)
    lam = damping(gram, 0.01)
    k, q = int(counts.max()) + 2, int((24 - counts).max()) + 2  # vacant slots in every row
    solved = rs.build_state(weight, keep, gram, lam, k, q, triangular_inverse=False)
    triangular = rs.build_state(weight, keep, gram, lam, k, q, triangular_inverse=True)
    default = rs.build_state(weight, keep, gram, lam, k, q)  # on the CPU: cholesky_inverse
    for f in fields(rs.RefitState):
        assert torch.equal(getattr(default, f.name), getattr(solved, f.name)), f.name
    for name in ("kept", "kept_ok", "pruned", "pruned_ok"):
        assert torch.equal(getattr(triangular, name), getattr(solved, name))
    for name in ("inv", "coef", "resid", "schur", "z"):
        a, b = getattr(triangular, name), getattr(solved, name)
        assert a.is_contiguous() and b.is_contiguous() and torch.allclose(a, b, rtol=1e-9, atol=1e-12), name
    transposed = rs.build_state(weight, keep, gram, lam, k, q, transposed_z=True)
    assert transposed.z.mT.is_contiguous() and torch.allclose(transposed.z, solved.z, rtol=1e-9, atol=1e-12)
    for name in ("resid", "schur"):
        assert torch.allclose(getattr(transposed, name), getattr(solved, name), rtol=1e-9, atol=1e-12)
    for state in (solved, triangular, transposed):
        vacant = ~state.kept_ok
        assert not state.z[vacant].any() and not state.inv[vacant].any() and not state.coef[vacant].any()
        assert not state.inv.mT[vacant].any() and not state.z.mT[~state.pruned_ok].any()  # columns too
    rows, floor = torch.arange(6), rs.pivot_floor(gram, lam)
    chosen = [rs.scan_swaps(state, weight, rows, floor)[1:] for state in (triangular, solved)]
    assert all(torch.equal(a, b) for a, b in zip(*chosen, strict=True))  # the same swaps


def test_row_batches_resync_and_unequal_counts():
    weight, gram = layer_problem(9, 24, seed=9)
    keep = warmstart_mask(weight, "wanda", sparsity=0.5, gram=gram, scope="layer")  # unequal row counts
    keep[0] = False  # a fully pruned row and a dense one
    keep[1] = True
    whole = refine_mask(weight, gram, keep, max_iters=30, objective="refit", ridge="mean")
    batched = refine_mask(
        weight, gram, keep, max_iters=30, objective="refit", row_batch=2, resync_every=2, ridge="mean"
    )
    assert torch.equal(whole.mask, batched.mask)
    assert torch.equal(whole.n_swaps, batched.n_swaps)
    assert torch.allclose(whole.weight, batched.weight, rtol=1e-9, atol=1e-12)
    assert torch.equal(whole.mask.sum(1), keep.sum(1))
    assert whole.n_swaps[:2].tolist() == [0, 0]
    assert not whole.weight[0].any()
    assert torch.allclose(
        whole.refit_loss_before, fit_loss(weight, gram, refit_weights(weight, gram, keep, ridge="mean"))
    )
    assert torch.allclose(whole.loss_before, row_losses(weight, gram, keep), rtol=1e-12)
    zero = refine_mask(weight, gram, keep, max_iters=0, objective="refit", ridge="mean")
    assert torch.equal(zero.mask, keep) and torch.equal(zero.loss_before, zero.loss_after)
    assert torch.equal(zero.refit_loss_before, zero.refit_loss_after)


def test_refit_row_batches_are_padded_to_their_own_counts(monkeypatch):
    weight, gram = layer_problem(9, 24, seed=9)
    keep = warmstart_mask(weight, "wanda", sparsity=0.5, gram=gram, scope="layer")  # unequal row counts
    seen, init = [], RefitRows.__init__

    def spy(self, *args, row_index=None, **kwargs):
        init(self, *args, row_index=row_index, **kwargs)
        seen.append((row_index.tolist(), self.k_slots, self.q_slots))

    monkeypatch.setattr(RefitRows, "__init__", spy)
    batched = refine_mask(weight, gram, keep, max_iters=5, objective="refit", row_batch=2, ridge="mean")
    counts = keep.sum(1)
    order = [r for rows, _, _ in seen for r in rows]
    assert sorted(order) == list(range(9)) and counts[order].tolist() == sorted(counts.tolist(), reverse=True)
    assert len(set(counts.tolist())) > 2
    for rows, k_slots, q_slots in seen:  # each batch padded to its own largest kept and pruned counts
        assert k_slots == int(counts[rows].max()) and q_slots == 24 - int(counts[rows].min())
    monkeypatch.undo()
    whole = refine_mask(weight, gram, keep, max_iters=5, objective="refit", ridge="mean")
    assert torch.equal(whole.mask, batched.mask) and torch.equal(whole.n_swaps, batched.n_swaps)


def test_zero_weights_are_never_restored():
    weight, gram = layer_problem(4, 16, seed=2)
    weight[:, :4] = 0.0
    keep = warmstart_mask(weight, "magnitude", sparsity=0.5)
    res = refine_mask(weight, gram, keep, max_iters=50, objective="refit", ridge="mean")
    assert not res.mask[:, :4].any()


def test_errors_name_the_rows_and_the_fix():
    weight, gram = layer_problem(4, 8, seed=1)
    gram[:, 0] = gram[0, :] = 0.0  # input 0 never active: singular whenever it is kept
    keep = warmstart_mask(weight, "magnitude", sparsity=0.5)
    keep[2, 0], keep[2, 1] = True, False
    keep[3, 0], keep[3, 2] = True, False
    keep[0:2, 0] = False
    with pytest.raises(ValueError, match=r"singular for rows \[2, 3\].*damp > 0"):
        refine_mask(weight, gram, keep, objective="refit", damp=0.0, ridge="mean")
    with pytest.raises(ValueError, match=r"singular for rows \[2\]"):  # layer row indices, batch by batch
        refine_mask(weight, gram, keep, objective="refit", damp=0.0, row_batch=1, ridge="mean")
    more = keep.clone()
    more[3, 1] = True  # row 3 keeps the most inputs: its batch comes first
    with pytest.raises(ValueError, match=r"singular for rows \[3\]"):
        refine_mask(weight, gram, more, objective="refit", damp=0.0, row_batch=1, ridge="mean")
    assert refine_mask(weight, gram, keep, objective="refit", damp=0.01, ridge="mean").weight.isfinite().all()
    bad = weight.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        refine_mask(bad, gram, keep, objective="refit", ridge="mean")
    with pytest.raises(ValueError, match="objective"):
        refine_mask(weight, gram, keep, objective="refitted", ridge="mean")
    with pytest.raises(ValueError, match="damp"):
        refine_mask(weight, gram, keep, objective="refit", damp=-0.1, ridge="mean")
    with pytest.raises(ValueError, match="resync_every"):
        refine_mask(weight, gram, keep, objective="refit", resync_every=0, ridge="mean")


def test_default_row_batch_grows_with_the_cuda_devices_memory(monkeypatch):
    """On CUDA the re-fit state's default row batch is a share of the device's memory, not the CPU's 128 MiB."""
    from types import SimpleNamespace

    from sparseswaps_prune.core import refine

    keep = torch.zeros(4096, 4096, dtype=torch.bool)
    keep[:, :1638] = True
    per_row = 1638 * (4096 - 1638)
    assert refine._default_row_batch(keep, True, 0, torch.device("cpu")) == rs.REFIT_ELEMENTS // per_row == 4
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2**30))
    want = int(80 * 2**30 * rs.REFIT_CUDA_FRACTION) // 8 // per_row
    assert refine._default_row_batch(keep, True, 0, torch.device("cuda")) == want == 83
    assert refine._default_row_batch(keep, False, 0, torch.device("cuda")) == refine.ROW_BATCH_ELEMENTS // 4096
