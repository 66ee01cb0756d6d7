"""benchmarks/common.py: the helpers the benchmark scripts share."""

from __future__ import annotations


def test_pattern_options(benchmark_script):
    common = benchmark_script("common")
    assert common.pattern_options("60%") == {"sparsity": 0.6, "nm": None}
    assert common.pattern_options("2:4") == {"sparsity": None, "nm": (2, 4)}


def test_random_layer_has_the_patterns_mask_in_the_asked_dtype(benchmark_script):
    import torch

    common = benchmark_script("common")
    weight, gram, keep = common.random_layer(40, 3, "60%")
    assert weight.dtype == gram.dtype == torch.float32 and weight.shape == (3, 40) and gram.shape == (40, 40)
    assert (keep.sum(dim=1) == 16).all()  # 24 of 40 pruned per row
    weight64, gram64, keep24 = common.random_layer(40, 3, "2:4", dtype=torch.float64)
    assert weight64.dtype == gram64.dtype == torch.float64 and torch.equal(weight64, weight.double())
    assert (keep24.view(3, 10, 4).sum(dim=2) == 2).all()


def test_timed_warms_up_once_then_averages(benchmark_script, monkeypatch):
    from types import SimpleNamespace

    common = benchmark_script("common")
    clock, calls = [0.0], []

    def call():  # the k-th call takes k seconds on a fake clock
        calls.append(1)
        clock[0] += len(calls)

    monkeypatch.setattr(common, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    seconds = common.timed(call, repeat=4)
    assert len(calls) == 5 and seconds == (2 + 3 + 4 + 5) / 4  # the warm-up call (1 s) is not timed


def test_the_shared_bound_and_the_lazy_build_match_the_state(benchmark_script):
    import torch

    from sparseswaps_prune.core import refit_swaps as rs
    from sparseswaps_prune.core.refit import damping

    common = benchmark_script("common")
    weight, gram, keep = common.random_layer(48, 5, dtype=torch.float64)
    keep[0, :4] = ~keep[0, :4]  # rows with different kept counts
    weight[2, ~keep[2]] = weight[2, ~keep[2]] * (torch.arange(48)[~keep[2]] % 3 != 0)  # exact zeros: not restorable
    lam = damping(gram, 0.01)
    counts = keep.sum(dim=1)
    state = rs.build_state(weight, keep, gram, lam, int(counts.max()), int((48 - counts).max()))
    shared = common.shared_schur_bound(gram, lam)
    ok = state.pruned_ok
    assert (shared[state.pruned][ok] <= state.schur[ok] * (1 + 1e-12)).all()  # below every row's s_p
    assert (shared[state.pruned][ok] < state.schur[ok] * 0.999).any()
    rows = torch.arange(5)
    best = rs.scan_swaps(state, weight, rows, rs.pivot_floor(gram, lam))[0]
    visits = common.bound_visits(state, weight, rows, best, shared[state.pruned])
    exact = (rs.restorable(state, weight, rows) & (-state.resid.square() / state.schur <= best[:, None])).sum(1)
    assert torch.equal(common.bound_visits(state, weight, rows, best, state.schur), exact)
    assert (visits >= exact).all() and (exact >= 1).all()  # the winner's column, at least

    hdiag, coef, resid, inputs, schur, z = common.lazy_build(weight, keep, gram, lam, shared, int(visits.max()))
    assert torch.allclose(hdiag * state.kept_ok, state.inv.diagonal(dim1=1, dim2=2), rtol=1e-9, atol=0)
    assert torch.allclose(coef, state.coef, rtol=1e-9, atol=1e-12)
    assert torch.allclose(resid.gather(1, state.pruned) * ok, state.resid, rtol=1e-9, atol=1e-9)
    visited = torch.arange(inputs.shape[1]) < visits[:, None]  # each row's first visits[i] columns
    assert not keep.gather(1, inputs)[visited].any() and (weight.gather(1, inputs)[visited] != 0).all()
    slot = (state.pruned[:, None, :] == inputs[:, :, None]).to(torch.int8).argmax(dim=2)  # [R, c] their slots
    assert torch.allclose(schur[visited], state.schur.gather(1, slot)[visited], rtol=1e-9, atol=0)
    z_state = state.z.gather(2, slot[:, None, :].expand_as(z))
    assert torch.allclose(z.mT[visited], z_state.mT[visited], rtol=1e-7, atol=1e-12)
