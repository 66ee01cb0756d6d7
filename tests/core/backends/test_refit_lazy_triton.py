"""The re-fit objective's Triton engine (``refit_lazy_triton.TritonRefitState``: the lazy state with its scan and
moves in Triton kernels) against the torch reference. Without a GPU the kernels run in the Triton interpreter on CPU
tensors (``TRITON_INTERPRET=1``, set in tests/conftest.py); with CUDA the same tests run the compiled kernels."""

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytest.importorskip("triton")

from sparseswaps_prune import refine_mask, warmstart_mask  # noqa: E402
from sparseswaps_prune.core import refit_swaps as rs  # noqa: E402
from sparseswaps_prune.core.backends import refit_lazy, refit_lazy_triton  # noqa: E402
from sparseswaps_prune.core.backends.refit_lazy_triton import TritonRefitState  # noqa: E402
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
    """The torch reference's state (a spare slot of each kind)."""
    counts, d = keep.sum(1), keep.shape[1]
    lam = damping(gram, damp)
    state = rs.build_state(weight, keep, gram, lam, min(d, int(counts.max()) + 1), min(d, int((d - counts).max()) + 1))
    return state, lam


def _engine(weight, gram, keep, nm=None, damp=0.01, spare=1, **kwargs):
    """The Triton engine's freshly built state (no pending terms; ``spare`` slots of each kind)."""
    counts, d = keep.sum(1), keep.shape[1]
    lam = damping(gram, damp)
    k, q = min(d, int(counts.max()) + spare), min(d, int((d - counts).max()) + spare)
    state = TritonRefitState(weight, keep.clone(), gram, lam, k, q, nm[1] if nm else None, **kwargs)
    assert state.zt.is_contiguous() and state.inv.is_contiguous()  # the layout the kernels address
    return state, lam


@pytest.mark.parametrize(("nm", "sparsity", "tile"), [(None, 0.6, None), (None, 0.3, None), ((2, 4), None, None),
                                                     ((2, 4), None, (4, 8, 1))])  # fmt: skip
@pytest.mark.parametrize("q_splits", [None, 1, 3])
def test_scan_is_bit_identical_to_the_reference(nm, sparsity, tile, q_splits, monkeypatch):
    """The kernel's costs and slots on a state without pending terms: the torch reference scan's of the same state,
    bit for bit."""
    if tile is not None:  # N:M: narrow tiles, each with its own range of kept slots
        monkeypatch.setattr(refit_lazy_triton, "SCAN_TILE", tile)
    weight, gram, keep = _layer(7, 300, seed=3, nm=nm, sparsity=sparsity)
    state, lam = _engine(weight, gram, keep, nm)
    floor = rs.pivot_floor(gram, lam)
    m = nm[1] if nm else None
    rows = torch.tensor([6, 0, 3, 1], device=DEVICE)  # a subset, out of order
    ref = rs.scan_swaps(state, weight, rows, floor, m)
    got = refit_lazy_triton.scan_swaps(state, rows, q_splits=q_splits)
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
    state, lam = _engine(weight, gram, keep)
    rows = torch.arange(3, device=DEVICE)
    ref = rs.scan_swaps(state, weight, rows, rs.pivot_floor(gram, lam))
    got = refit_lazy_triton.scan_swaps(state, rows, q_splits=2)
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
    got = refit_lazy_triton.best_slots(*args, d)
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
        return refit_lazy_triton.columns_to_scan(state, rows, terms, rs.restorable(state, weight, rows), floor, m)

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
    k_lo, k_hi = refit_lazy_triton.kept_slot_ranges(kept, kept_ok, pruned, scanned, 4, 32)
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
    k_lo, k_hi = refit_lazy_triton.kept_slot_ranges(kept, kept_ok, pruned, scanned, 4, 32)
    assert (k_lo[5] == 0).all() and (k_hi[5] == kept.shape[1]).all() and (k_hi[4] - k_lo[4] <= 2 * 16).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_cuda_engine_at_a_larger_width():
    weight, gram, keep = _layer(40, 1024, seed=5)
    state, lam = _engine(weight, gram, keep)
    rows = torch.arange(40, device=DEVICE)
    floor = rs.pivot_floor(gram, lam)
    for g, r in zip(refit_lazy_triton.scan_swaps(state, rows), rs.scan_swaps(state, weight, rows, floor), strict=True):
        assert torch.equal(g, r)
    runs = [
        refine_mask(
            weight, gram, keep, max_iters=40, objective="refit", damp=0.01, backend=b, row_batch=16, ridge="mean"
        )
        for b in ("torch", "triton")
    ]
    assert torch.equal(runs[0].mask, runs[1].mask) and int(runs[1].n_swaps.sum()) > 40


def test_the_engines_slot_counts_are_aligned_for_the_kernels():
    weight, gram, keep = _layer(5, 72, seed=9)  # 29 kept and 43 pruned inputs per row at most
    model = RefitRows(weight, keep.clone(), gram, lam=damping(gram, 0.01), m=None, row_batch=5, cross=False,
                      engine="triton")  # fmt: skip
    assert isinstance(model.state, TritonRefitState)
    assert (model.k_slots, model.q_slots) == (32, 48) == model.state.slots == tuple(model.state.zt.shape[:0:-1])
    torch_model = RefitRows(weight, keep.clone(), gram, lam=damping(gram, 0.01), m=None, row_batch=5, cross=False)
    assert torch_model.k_slots < 32 and torch_model.q_slots < 48  # the other engines keep the counts
    assert refit_lazy_triton.aligned_slots(70, 72) == 72  # never past d_in


@pytest.mark.parametrize("nm", [None, (2, 4)])
def test_the_scan_of_a_lazy_state_reads_its_pending_terms(nm):
    """The kernel on the state with pending terms (``Z0^T`` plus terms, folded every second swap here) chooses the
    torch reference's swaps, with its costs up to the state's rounding, before and after folds."""
    weight, gram, keep = _layer(7, 300, seed=4, nm=nm)
    lam, d, counts = damping(gram, 0.01), keep.shape[1], keep.sum(1)
    k, q = (refit_lazy_triton.aligned_slots(n, d) for n in (int(counts.max()), d - int(counts.min())))
    m = nm[1] if nm else None
    lazy = TritonRefitState(weight, keep.clone(), gram, lam, k, q, m, factor_slots=4)
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
    [("row", None, 32, 40, 4), ("row", (2, 4), 32, 40, 4), ("layer", None, 32, 40, 4), ("layer", None, 32, 40, 64),
     ("row", None, 300, 6, 4), ("row", (2, 4), 300, 6, 4)],  # over several of the kernels' blocks of slots
)  # fmt: skip
def test_the_triton_engine_chooses_the_torch_engines_swaps(scope, nm, d_in, iters, slots, monkeypatch):
    """``backend="triton"``: the Triton engine (swaps, and across rows removals and restores, in its kernels), folding
    every ``slots / 2`` swaps, against the torch reference."""
    weight, gram, keep = _layer(6, d_in, seed=7 if d_in == 32 else 4, nm=nm)
    options = {"max_iters": iters, "nm": nm, "objective": "refit", "damp": 0.01, "scope": scope}
    reference = refine_mask(weight, gram, keep, backend="torch", **options)
    calls = []
    moves = refit_lazy_triton.moves

    def spy(state, mode, rows, *args):
        calls.append(mode)
        return moves(state, mode, rows, *args)

    monkeypatch.setattr(refit_lazy, "FACTOR_SLOTS", slots)
    monkeypatch.setattr(refit_lazy_triton, "moves", spy)
    run = refine_mask(weight, gram, keep, backend="triton", **options)
    assert refit_lazy_triton.SWAP in calls
    if scope == "layer":  # cross-row moves through the kernels too
        assert {refit_lazy_triton.REMOVE, refit_lazy_triton.ADD} <= set(calls)
    assert torch.equal(reference.mask, run.mask)
    assert reference.n_swaps.tolist() == run.n_swaps.tolist() and int(run.n_swaps.sum()) > 0
    torch.testing.assert_close(reference.weight, run.weight, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("nm", [None, (2, 4)])
def test_the_kernel_moves_are_the_references_moves(nm):
    """Swaps, removals and restores by the kernels give the torch reference's state (up to rounding), across folds:
    the same slots, and ``v``, ``r``, ``s``, ``diag H`` and ``Z`` (base plus pending terms) to rounding."""
    weight, gram, keep = _layer(7, 300, seed=4, nm=nm)
    lam, d, counts = damping(gram, 0.01), keep.shape[1], keep.sum(1)
    spare = 16  # vacant slots for the removals and restores
    k, q = (refit_lazy_triton.aligned_slots(n, d) + spare for n in (int(counts.max()), d - int(counts.min())))
    m = nm[1] if nm else None
    lazy = TritonRefitState(weight, keep.clone(), gram, lam, k, q, m, factor_slots=4)
    want = rs.build_state(weight, keep, gram, lam, k, q)
    floor = rs.pivot_floor(gram, lam)
    for step in range(6):
        rows = torch.tensor([6, 0, 3, 1][step % 2 :], device=DEVICE)
        _, slot_i, slot_j = lazy.scan(rows)
        assert torch.equal(torch.stack(rs.scan_swaps(want, weight, rows, floor, m)[1:]), torch.stack([slot_i, slot_j]))
        if step in (2, 3):  # a removal into a vacant pruned slot, then a restore into the vacant kept slot
            vacant_j = (~want.pruned_ok[rows]).to(torch.int8).argmax(dim=1)
            incoming = rs.remove_kept(want, rows, slot_i)
            rs.place_pruned(want, rows, vacant_j, incoming)
            assert torch.equal(lazy.remove(rows, slot_i, vacant_j), incoming[0])
            vacant_i = (~want.kept_ok[rows]).to(torch.int8).argmax(dim=1)
            p = want.pruned[rows, slot_j]
            rs.add_pruned(want, rows, slot_j, vacant_i, gram)
            assert torch.equal(lazy.add(rows, slot_j, vacant_i), p)
        else:
            assert torch.equal(torch.stack(lazy.swap(rows, slot_i, slot_j)),
                               torch.stack(rs.swap_slots(want, rows, slot_i, slot_j, gram)))  # fmt: skip
        for name in ("kept", "kept_ok", "pruned", "pruned_ok"):
            assert torch.equal(getattr(lazy, name), getattr(want, name)), name
        for name in ("coef", "resid", "schur"):
            torch.testing.assert_close(getattr(lazy, name), getattr(want, name), rtol=1e-9, atol=1e-9)
        all_rows = torch.arange(7, device=DEVICE)
        torch.testing.assert_close(lazy.h_diagonal(all_rows), want.h_diagonal(all_rows), rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(lazy.z_rows(all_rows), want.z, rtol=1e-9, atol=1e-9)
    assert int(lazy.rank.max()) > 0


@pytest.mark.parametrize("nm", [None, (2, 4)])
def test_the_lazy_states_scan_terms_kernel_gives_the_torch_prologues_terms(nm):
    """``refit_lazy_triton.scan_terms`` (one kernel) against its torch references (the reference's gathers,
    ``columns_to_scan``, ``kept_slot_ranges``) on a state with pending terms: the same terms bit for bit and the same
    slots to scan, also where a broken ``H_uu <= 0`` makes a row scan every restorable slot."""
    weight, gram, keep = _layer(7, 300, seed=4, nm=nm)
    lam, d, counts = damping(gram, 0.01), keep.shape[1], keep.sum(1)
    k, q = (refit_lazy_triton.aligned_slots(n, d) for n in (int(counts.max()), d - int(counts.min())))
    m = nm[1] if nm else None
    lazy = TritonRefitState(weight, keep.clone(), gram, lam, k, q, m)
    rows = torch.tensor([6, 0, 3, 1], device=DEVICE)
    for _ in range(2):  # pending terms
        _, slot_i, slot_j = lazy.scan(rows)
        lazy.swap(rows, slot_i, slot_j)
    assert int(lazy.rank.max()) == 4
    lazy.hdiag[3, int(lazy.kept_ok[3].to(torch.int8).argmax())] = -1.0  # row 3: no bound
    if nm:  # row 6: kept slots out of block order (every kept slot is in range); vacant slots stay last
        lazy.kept[6, [0, 2]] = lazy.kept[6, [2, 0]]  # two blocks
    for tile_q in (32, 8, 256):  # more tiles than a block of the kernel, fewer, one tile wider than its block
        got = refit_lazy_triton.scan_terms(lazy, rows, refit_lazy_triton.THRESHOLD_COLUMNS, tile_q)
        h_safe, ratio, remove = rs.removal_terms(lazy, rows)
        ok = rs.restorable(lazy, weight, rows)
        need = refit_lazy_triton.columns_to_scan(lazy, rows, (h_safe, ratio, remove), ok, lazy.floor, m)
        kept, kept_ok, pruned = lazy.kept[rows], lazy.kept_ok[rows], lazy.pruned[rows]
        want = [ratio, h_safe, remove, kept, kept_ok.to(torch.int8), lazy.resid[rows], lazy.schur[rows], pruned,
                ok.to(torch.int8), lazy.floor[pruned], need.to(torch.int8)]  # fmt: skip
        if nm:  # and the N:M ranges of the tiles' kept slots
            want += refit_lazy_triton.kept_slot_ranges(kept, kept_ok, pruned, need, m, tile_q)
            (k_lo, k_hi), n_tiles = want[-2:], want[-1].shape[1]
            assert k_lo[0].tolist() == [0] * n_tiles and k_hi[0].tolist() == [k] * n_tiles  # row 6: all
            assert int(k_lo[1:].max()) > 0 and int(k_hi[1:].min()) < k  # the others: ranges
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.dtype == w.dtype and torch.equal(g, w), (tile_q, i)
    assert torch.equal(need[2], ok[2]) and int(need[:2].sum()) < int(ok[:2].sum())  # the bound skips, but not row 3
