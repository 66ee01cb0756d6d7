"""The re-fit objective's fused Triton engine against the torch reference. Without a GPU the kernels run in the
Triton interpreter on CPU tensors (``TRITON_INTERPRET=1``, set in tests/conftest.py); with CUDA the same tests run
the compiled kernels."""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytest.importorskip("triton")

from sparseswaps_prune import refine_mask, warmstart_mask  # noqa: E402
from sparseswaps_prune.core import refine  # noqa: E402
from sparseswaps_prune.core import refit_swaps as rs  # noqa: E402
from sparseswaps_prune.core.backends import refit_triton, resolve_refit_backend, triton_available  # noqa: E402
from sparseswaps_prune.core.backends.refit_lazy import LazyRefitState  # noqa: E402
from sparseswaps_prune.core.refine import RefitRows  # noqa: E402
from sparseswaps_prune.core.refit import damping  # noqa: E402


def _layer(d_out, d_in, seed, nm=None, sparsity=0.6):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3 * d_in, d_in, generator=gen, dtype=torch.float64) @ (
        torch.eye(d_in, dtype=torch.float64) + torch.randn(d_in, d_in, generator=gen, dtype=torch.float64) / 4
    )
    weight = torch.randn(d_out, d_in, generator=gen, dtype=torch.float64)
    weight[1, 2::5] = 0.0  # exact zeros: never restored
    keep = warmstart_mask(weight, "magnitude", nm=nm) if nm else warmstart_mask(weight, "magnitude", sparsity=sparsity)
    return weight.to(DEVICE), (x.T @ x).to(DEVICE), keep.to(DEVICE)


def _state(weight, gram, keep, damp=0.01):
    counts, d = keep.sum(1), keep.shape[1]
    lam = damping(gram, damp)
    state = rs.build_state(weight, keep, gram, lam, min(d, int(counts.max()) + 1), min(d, int((d - counts).max()) + 1))
    assert state.z.is_contiguous() and state.inv.is_contiguous()  # the layout the kernels address
    return state, lam


@pytest.mark.parametrize(("nm", "sparsity", "tile"), [(None, 0.6, None), (None, 0.3, None), ((2, 4), None, None),
                                                     ((2, 4), None, (4, 8, 1))])  # fmt: skip
@pytest.mark.parametrize("q_splits", [None, 1, 3])
def test_scan_is_bit_identical_to_the_reference(nm, sparsity, tile, q_splits, monkeypatch):
    if tile is not None:  # N:M: narrow tiles, each with its own range of kept slots
        monkeypatch.setattr(refit_triton, "SCAN_TILE", tile)
    weight, gram, keep = _layer(7, 300, seed=3, nm=nm, sparsity=sparsity)
    state, lam = _state(weight, gram, keep)
    floor = rs.pivot_floor(gram, lam)
    m = nm[1] if nm else None
    rows = torch.tensor([6, 0, 3, 1], device=DEVICE)  # a subset, out of order
    ref = rs.scan_swaps(state, weight, rows, floor, m)
    got = refit_triton.scan_swaps(state, weight, rows, floor, m, q_splits=q_splits)
    assert torch.isfinite(ref[0]).all()
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r)


def test_scan_ties_and_rows_without_a_pair():
    d = 40
    gram = torch.eye(d, dtype=torch.float64, device=DEVICE)  # every swap of equal weights costs the same
    weight = torch.ones(3, d, dtype=torch.float64, device=DEVICE)
    keep = torch.zeros(3, d, dtype=torch.bool, device=DEVICE)
    keep[:, d // 2 :] = True
    keep[1] = True  # nothing to restore
    weight[2, : d // 2] = 0.0  # every pruned weight an exact zero
    state, lam = _state(weight, gram, keep)
    rows = torch.arange(3, device=DEVICE)
    ref = rs.scan_swaps(state, weight, rows, rs.pivot_floor(gram, lam))
    got = refit_triton.scan_swaps(state, weight, rows, rs.pivot_floor(gram, lam), q_splits=2)
    assert abs(float(ref[0][0])) < 1e-12 and torch.isinf(ref[0][1:]).all()
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r)
    assert (int(state.kept[0, got[1][0]]), int(state.pruned[0, got[2][0]])) == (d // 2, 0)  # smallest u, then p


def test_best_slots_reduces_the_partial_minima_as_torch_does():
    d, k_slots, q_slots = 600, 300, 290  # slots over one kernel block (BEST_SLOTS_BLOCK)
    inf, no_key = float("inf"), torch.iinfo(torch.long).max
    part_val = torch.tensor([[-2.0, -3.0, -3.0], [inf, inf, inf], [1.0, -1.0, inf], [-5.0, inf, inf], [-1.0, 0, 0]])
    part_key = torch.tensor([[7, 9 * d + 4, 5 * d + 280], [no_key, 3, no_key], [1, 4 * d + 9, no_key], [0, 0, 0],
                             [7 * d + 300, 0, 0]])  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    kept = torch.randint(10, 250, (5, k_slots), generator=gen)  # none of the winners below
    pruned = torch.randint(10, 250, (5, q_slots), generator=gen)
    kept_ok = torch.ones(5, k_slots, dtype=torch.bool)
    pruned_ok = torch.ones(5, q_slots, dtype=torch.bool)
    kept[4, 17], pruned[4, 100] = 7, 300  # in the first block of slots
    kept[0, [3, 260]], kept_ok[0, 3] = 5, False  # the winner u = 5: a vacant slot before the occupied one
    pruned[0, [2, 270]], pruned_ok[0, 2] = 280, False  # p = 280 likewise
    kept[2, 299], pruned[2, 289] = 4, 9  # in the last slots
    kept[3], pruned[3] = d - 1, d - 1  # the winner (0, 0) in no slot: slots 0 and 0
    best = part_val.min(dim=1).values  # scan_swaps' torch reduction before the kernel
    key = torch.where(part_val == best[:, None], part_key, no_key).min(dim=1).values
    found, u, p = best < inf, key // d, key % d
    slot_i = torch.where(found, ((kept == u[:, None]) & kept_ok).to(torch.int8).argmax(dim=1), 0)
    slot_j = torch.where(found, ((pruned == p[:, None]) & pruned_ok).to(torch.int8).argmax(dim=1), 0)
    args = [t.to(DEVICE) for t in (part_val, part_key, kept, kept_ok.to(torch.int8), pruned, pruned_ok.to(torch.int8))]
    got = refit_triton.best_slots(*args, d)
    assert [t.tolist() for t in (slot_i, slot_j)] == [[260, 0, 299, 0, 17], [270, 0, 289, 0, 100]]
    for g, r in zip(got, (best, slot_i, slot_j), strict=True):
        assert torch.equal(g.cpu(), r)


@pytest.mark.parametrize(("nm", "most"), [(None, 3), ((2, 4), 12)])
def test_the_scan_skips_slots_by_the_bound(nm, most):
    weight, gram, keep = _layer(7, 300, seed=3, nm=nm)
    state, lam = _state(weight, gram, keep)
    floor = rs.pivot_floor(gram, lam)
    rows = torch.arange(7, device=DEVICE)
    m = nm[1] if nm else None

    def need():
        terms = rs.removal_terms(state, rows)
        return refit_triton.columns_to_scan(state, rows, terms, rs.restorable(state, weight, rows), floor, m)

    _, _, slot_j = rs.scan_swaps(state, weight, rows, floor, m)
    needed = need()
    assert needed[torch.arange(7, device=DEVICE), slot_j].all()  # the winner's slot is scanned
    assert int(needed.sum(dim=1).max()) <= most  # of 150-180 pruned slots per row
    i0 = int(state.kept_ok[2].to(torch.int8).argmax())
    state.inv[2, i0, i0] = -1.0  # a broken state has no bound: every restorable slot is scanned
    assert torch.equal(need()[2], rs.restorable(state, weight, rows)[2])
    restorable = rs.restorable(state, weight, rows)[4]
    top = int(torch.where(restorable, -state.resid[4].square() / state.schur[4], 1.0).argmin())
    pair = state.kept_ok[4] & ((state.kept[4] // m == state.pruned[4, top] // m) if m else True)
    state.z[4, int(pair.to(torch.int8).argmax()), top] = float("inf")  # a NaN cost there: no threshold
    assert torch.equal(need()[4], rs.restorable(state, weight, rows)[4])


def test_kept_slot_ranges_hold_exactly_the_kept_inputs_of_the_tiles_blocks():
    weight, gram, keep = _layer(7, 300, seed=3, nm=(2, 4))
    state, _ = _state(weight, gram, keep)
    rows = torch.arange(7, device=DEVICE)
    kept, kept_ok, pruned = state.kept[rows], state.kept_ok[rows], state.pruned[rows]
    scanned = rs.restorable(state, weight, rows)
    scanned[3, :40] = False  # tile 0 of row 3 scans nothing, tile 1 half of its slots
    k_lo, k_hi = refit_triton.kept_slot_ranges(kept, kept_ok, pruned, scanned, 4, 32)
    assert k_lo.shape == (7, 5)
    for r in range(7):
        for t in range(5):
            blocks = (pruned[r, 32 * t : 32 * (t + 1)] // 4)[scanned[r, 32 * t : 32 * (t + 1)]]
            pairs = kept_ok[r] & torch.isin(kept[r] // 4, blocks)  # kept slots a scanned slot's block holds
            inside = torch.zeros_like(pairs)
            inside[k_lo[r, t] : k_hi[r, t]] = True
            assert torch.equal(pairs, inside), (r, t)  # exactly those, contiguous
    assert k_lo[3, 0] >= k_hi[3, 0] and k_hi[3, 1] - k_lo[3, 1] < k_hi[2, 1] - k_lo[2, 1]
    kept[5] = kept[5].flip(0)  # slots not sorted by block: every kept slot
    k_lo, k_hi = refit_triton.kept_slot_ranges(kept, kept_ok, pruned, scanned, 4, 32)
    assert (k_lo[5] == 0).all() and (k_hi[5] == kept.shape[1]).all() and (k_hi[4] - k_lo[4] <= 2 * 16).all()


def test_updates_match_the_reference():
    weight, gram, keep = _layer(5, 70, seed=1)
    state, _ = _state(weight, gram, keep)
    rows = torch.tensor([4, 1], device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, state.z.shape[1], generator=gen, dtype=torch.float64).to(DEVICE)
    b = torch.randn(2, state.z.shape[2], generator=gen, dtype=torch.float64).to(DEVICE)
    want = state.z.clone()
    rs.add_outer(want, rows, a, b)
    refit_triton.add_outer(state.z, rows, a, b)
    assert torch.equal(state.z, want)  # no fma: the reference's rounding
    with pytest.raises(ValueError, match="contiguous"):
        refit_triton.add_outer(state.z.transpose(1, 2), rows, b, a)


@pytest.mark.parametrize("scope,nm", [("row", None), ("row", (2, 4)), ("layer", None)])
def test_engine_chooses_the_torch_engines_swaps(scope, nm, monkeypatch):
    weight, gram, keep = _layer(6, 32, seed=7, nm=nm)
    calls = []
    swap_slots = refit_triton.swap_slots

    def spy(*args, **kwargs):
        calls.append(args[1].numel())
        return swap_slots(*args, **kwargs)

    monkeypatch.setattr(refit_triton, "swap_slots", spy)
    runs = {
        engine: refine_mask(
            weight, gram, keep, max_iters=40, nm=nm, objective="refit", damp=0.01, scope=scope, backend=engine
        )
        for engine in ("torch", "triton")
    }
    assert torch.equal(runs["torch"].mask, runs["triton"].mask)
    assert runs["torch"].n_swaps.tolist() == runs["triton"].n_swaps.tolist()
    assert int(runs["triton"].n_swaps.sum()) > 0
    torch.testing.assert_close(runs["torch"].weight, runs["triton"].weight, rtol=1e-9, atol=1e-12)
    if scope == "row":  # the row scope's swaps run through the Triton engine's swap_slots
        assert sum(calls) > 0


def test_resolve_refit_backend(monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_refit_backend("auto", cpu) == "numba"
    assert resolve_refit_backend("torch", cpu) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_refit_backend("triton", cpu) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_refit_backend("triton", cpu)
    # auto on CUDA: the lazy engine where triton is installed (only the device's type is read: no GPU needed)
    assert resolve_refit_backend("auto", torch.device("cuda")) == ("lazy" if triton_available() else "torch")
    if torch.cuda.is_available():
        assert resolve_refit_backend("triton", torch.device("cuda")) == "triton"
        assert resolve_refit_backend("torch", torch.device("cuda")) == "torch"


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_cuda_engine_at_a_larger_width(monkeypatch):
    weight, gram, keep = _layer(40, 1024, seed=5)
    state, lam = _state(weight, gram, keep)
    rows = torch.arange(40, device=DEVICE)
    floor = rs.pivot_floor(gram, lam)
    for g, r in zip(refit_triton.scan_swaps(state, weight, rows, floor), rs.scan_swaps(state, weight, rows, floor),
                    strict=True):  # fmt: skip
        assert torch.equal(g, r)
    runs = [
        refine_mask(weight, gram, keep, max_iters=8, objective="refit", damp=0.01, backend=b, row_batch=16)
        for b in ("torch", "triton")
    ]
    assert torch.equal(runs[0].mask, runs[1].mask) and int(runs[1].n_swaps.sum()) > 0
    # the lazy state (pending terms, its scan the kernel) is an engine, not a backend name
    monkeypatch.setattr(refine, "resolve_refit_backend", lambda backend, device: "lazy")
    lazy = refine_mask(weight, gram, keep, max_iters=40, objective="refit", damp=0.01, row_batch=16)
    monkeypatch.undo()
    eager = refine_mask(weight, gram, keep, max_iters=40, objective="refit", damp=0.01, backend="triton", row_batch=16)
    assert torch.equal(lazy.mask, eager.mask) and int(lazy.n_swaps.sum()) > 40


@pytest.mark.parametrize(
    ("nm", "tile"),
    [
        (None, None),
        ((2, 4), None),
        (None, (2, 32, 1)),
        ((2, 4), (4, 8, 1)),  # N:M: narrow tiles, each with its own range of kept slots
    ],
)
def test_swap_slots_and_the_scan_after_it_are_bit_identical_to_the_reference(nm, tile, monkeypatch):
    if tile is not None:  # several tiles per row: the update's edges, the scan's running minimum
        monkeypatch.setattr(refit_triton, "SCAN_TILE", tile)
        monkeypatch.setattr(refit_triton, "OUTER_TILE", tile)
    # narrow tiles: 132 inputs still give several tiles per row with ragged edges (66 or 79 pruned slots, ...) at a
    # fifth of the interpreter's work
    weight, gram, keep = _layer(7, 300 if tile is None else 132, seed=4, nm=nm)
    state, lam = _state(weight, gram, keep)
    floor = rs.pivot_floor(gram, lam)
    m = nm[1] if nm else None
    want = rs.RefitState(*(t.clone() for t in vars(state).values()))
    for step in range(3):  # consecutive swaps of a subset of the rows, out of order
        rows = torch.tensor([6, 0, 3, 1][step:], device=DEVICE)
        _, slot_i, slot_j = rs.scan_swaps(want, weight, rows, floor, m)
        ref_up = rs.swap_slots(want, rows, slot_i, slot_j, gram)
        got_up = refit_triton.swap_slots(state, rows, slot_i, slot_j, gram)
        for g, r in zip(got_up, ref_up, strict=True):
            assert torch.equal(g, r)
        for name, value in vars(want).items():
            if name != "inv":
                assert torch.equal(getattr(state, name), value), name
        # H on and above its diagonal (all that is read); the kernel leaves the entries below it stale
        assert torch.equal(state.inv.triu(), want.inv.triu()) and state.same_as(want)
        assert not torch.equal(state.inv, want.inv)
        got, ref = refit_triton.scan_swaps(state, weight, rows, floor, m), rs.scan_swaps(want, weight, rows, floor, m)
        for g, r in zip(got, ref, strict=True):
            assert torch.equal(g, r)


def test_the_engines_slot_counts_are_aligned_for_the_kernels():
    weight, gram, keep = _layer(5, 72, seed=9)  # 29 kept and 43 pruned inputs per row at most
    model = RefitRows(weight, keep.clone(), gram, lam=damping(gram, 0.01), m=None, row_batch=5, cross=False,
                      engine="triton")  # fmt: skip
    assert (model.k_slots, model.q_slots) == (32, 48) == tuple(model.state.z.shape[1:])
    torch_model = RefitRows(weight, keep.clone(), gram, lam=damping(gram, 0.01), m=None, row_batch=5, cross=False)
    assert torch_model.k_slots < 32 and torch_model.q_slots < 48  # the other engines keep the counts
    assert refit_triton.aligned_slots(70, 72) == 72  # never past d_in


@pytest.mark.parametrize("nm", [None, (2, 4)])
def test_the_scan_of_a_lazy_state_reads_its_pending_terms(nm):
    """The kernel on a lazy state (``Z0^T`` plus pending terms, folded every second swap here) chooses the eager
    reference's swaps, with its costs up to the state's rounding, before and after folds."""
    weight, gram, keep = _layer(7, 300, seed=4, nm=nm)
    lam, d, counts = damping(gram, 0.01), keep.shape[1], keep.sum(1)
    k, q = (refit_triton.aligned_slots(n, d) for n in (int(counts.max()), d - int(counts.min())))
    m = nm[1] if nm else None
    lazy = LazyRefitState(weight, keep.clone(), gram, lam, k, q, m, factor_slots=4, triton_scan=True)
    want = rs.build_state(weight, keep, gram, lam, k, q)
    floor = rs.pivot_floor(gram, lam)
    ranks = []
    for step in range(5):  # consecutive swaps of a subset of the rows, out of order
        rows = torch.tensor([6, 0, 3, 1][step % 2 :], device=DEVICE)
        ranks.append(int(lazy.rank[rows].max()))
        got, ref = lazy.scan(rows), rs.scan_swaps(want, weight, rows, floor, m)
        assert torch.isfinite(ref[0]).all()
        assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
        torch.testing.assert_close(got[0], ref[0], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(lazy.z_rows(rows), want.z[rows], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(lazy.h_diagonal(rows), want.h_diagonal(rows), rtol=1e-9, atol=1e-9)
        ref_up = rs.swap_slots(want, rows, ref[1], ref[2], gram)
        for g, r in zip(lazy.swap(rows, got[1], got[2]), ref_up, strict=True):  # the inputs (u, p)
            assert torch.equal(g, r)
    assert max(ranks) == 4 and 2 in ranks[2:]  # pending terms read by the kernel, and folds


@pytest.mark.parametrize(
    "scope,nm,d_in,iters,slots",
    [("row", None, 32, 40, 4), ("row", (2, 4), 32, 40, 4), ("layer", None, 32, 40, 4),
     ("row", None, 300, 6, 4), ("row", (2, 4), 300, 6, 4)],  # over several of the kernels' blocks of slots
)  # fmt: skip
def test_the_lazy_states_kernels_choose_the_torch_engines_swaps(scope, nm, d_in, iters, slots, monkeypatch):
    """The lazy state with the kernel's scan and its moves in the two kernels of ``refit_lazy_triton`` (swaps, and
    across rows removals and restores), folds every ``slots / 2`` swaps, against the torch reference."""
    from sparseswaps_prune.core.backends import refit_lazy

    weight, gram, keep = _layer(6, d_in, seed=7 if d_in == 32 else 4, nm=nm)
    options = {"max_iters": iters, "nm": nm, "objective": "refit", "damp": 0.01, "scope": scope}
    reference = refine_mask(weight, gram, keep, backend="torch", **options)
    built = []

    def kernels(*args, **kwargs):
        built.append(refit_lazy.LazyRefitState(*args, **{**kwargs, "triton_scan": True, "factor_slots": slots}))
        return built[-1]

    monkeypatch.setattr(refine, "resolve_refit_backend", lambda backend, device: "lazy")
    monkeypatch.setattr(refine, "LazyRefitState", kernels)
    run = refine_mask(weight, gram, keep, backend="torch", **options)
    assert built and all(state.fused for state in built)  # FUSED: the kernels with the Triton scan
    assert torch.equal(reference.mask, run.mask)
    assert reference.n_swaps.tolist() == run.n_swaps.tolist() and int(run.n_swaps.sum()) > 0
    torch.testing.assert_close(reference.weight, run.weight, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("nm", [None, (2, 4)])
def test_the_lazy_states_kernel_moves_are_its_torch_moves(nm):
    """Swaps, removals and restores by the kernels give the torch moves' state (up to rounding), across folds."""
    weight, gram, keep = _layer(7, 300, seed=4, nm=nm)
    lam, d, counts = damping(gram, 0.01), keep.shape[1], keep.sum(1)
    k, q = (refit_triton.aligned_slots(n, d) + 16 for n in (int(counts.max()), d - int(counts.min())))  # spare slots
    m = nm[1] if nm else None
    states = [LazyRefitState(weight, keep.clone(), gram, lam, k, q, m, factor_slots=4, triton_scan=True,
                             fused=fused) for fused in (False, True)]  # fmt: skip
    for step in range(6):
        rows = torch.tensor([6, 0, 3, 1][step % 2 :], device=DEVICE)
        scans = [state.scan(rows) for state in states]
        assert torch.equal(scans[0][1], scans[1][1]) and torch.equal(scans[0][2], scans[1][2])
        if step in (2, 3):  # a removal into a vacant pruned slot, then a restore into the vacant kept slot
            vacant_j = (~states[0].pruned_ok[rows]).to(torch.int8).argmax(dim=1)
            out = [state.remove(rows, scans[0][1], vacant_j) for state in states]
            vacant_i = (~states[0].kept_ok[rows]).to(torch.int8).argmax(dim=1)
            out += [state.add(rows, scans[0][2], vacant_i) for state in states]
        else:
            out = [torch.stack(state.swap(rows, scans[0][1], scans[0][2])) for state in states]
        assert torch.equal(out[0], out[1])
        assert len(out) == 2 or torch.equal(out[2], out[3])
        for name in ("kept", "kept_ok", "pruned", "pruned_ok", "rank"):
            assert torch.equal(getattr(states[0], name), getattr(states[1], name)), name
        for name in ("hdiag", "coef", "resid", "schur", "zt", "inv", "fa", "fc", "fb"):
            torch.testing.assert_close(getattr(states[1], name), getattr(states[0], name), rtol=1e-9, atol=1e-9)
    assert int(states[1].rank.max()) > 0


@pytest.mark.parametrize("nm", [None, (2, 4)])
def test_the_lazy_states_scan_terms_kernel_gives_the_torch_prologues_terms(nm):
    """``refit_lazy_triton.scan_terms`` (one kernel) against the torch prologue of ``refit_triton.scan_swaps`` on a
    lazy state with pending terms: the same terms bit for bit and the same slots to scan, also where a broken
    ``H_uu <= 0`` makes a row scan every restorable slot."""
    from sparseswaps_prune.core.backends.refit_lazy_triton import scan_terms

    weight, gram, keep = _layer(7, 300, seed=4, nm=nm)
    lam, d, counts = damping(gram, 0.01), keep.shape[1], keep.sum(1)
    k, q = (refit_triton.aligned_slots(n, d) for n in (int(counts.max()), d - int(counts.min())))
    m = nm[1] if nm else None
    lazy = LazyRefitState(weight, keep.clone(), gram, lam, k, q, m, triton_scan=True)
    rows = torch.tensor([6, 0, 3, 1], device=DEVICE)
    for _ in range(2):  # pending terms
        _, slot_i, slot_j = lazy.scan(rows)
        lazy.swap(rows, slot_i, slot_j)
    assert int(lazy.rank.max()) == 4
    lazy.hdiag[3, int(lazy.kept_ok[3].to(torch.int8).argmax())] = -1.0  # row 3: no bound
    if nm:  # row 6: kept slots out of block order (every kept slot is in range); vacant slots stay last
        lazy.kept[6, [0, 2]] = lazy.kept[6, [2, 0]]  # two blocks
    for tile_q in (32, 8, 256):  # more tiles than a block of the kernel, fewer, one tile wider than its block
        got = scan_terms(lazy, rows, refit_triton.THRESHOLD_COLUMNS, tile_q)
        h_safe, ratio, remove = rs.removal_terms(lazy, rows)
        ok = rs.restorable(lazy, weight, rows)
        need = refit_triton.columns_to_scan(lazy, rows, (h_safe, ratio, remove), ok, lazy.floor, m)
        kept, kept_ok, pruned = lazy.kept[rows], lazy.kept_ok[rows], lazy.pruned[rows]
        want = [ratio, h_safe, remove, kept, kept_ok.to(torch.int8), lazy.resid[rows], lazy.schur[rows], pruned,
                ok.to(torch.int8), lazy.floor[pruned], need.to(torch.int8)]  # fmt: skip
        if nm:  # and the N:M ranges of the tiles' kept slots
            want += refit_triton.kept_slot_ranges(kept, kept_ok, pruned, need, m, tile_q)
            (k_lo, k_hi), n_tiles = want[-2:], want[-1].shape[1]
            assert k_lo[0].tolist() == [0] * n_tiles and k_hi[0].tolist() == [k] * n_tiles  # row 6: all
            assert int(k_lo[1:].max()) > 0 and int(k_hi[1:].min()) < k  # the others: ranges
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.dtype == w.dtype and torch.equal(g, w), (tile_q, i)
    assert torch.equal(need[2], ok[2]) and int(need[:2].sum()) < int(ok[:2].sum())  # the bound skips, but not row 3
