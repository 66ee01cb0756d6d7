"""Compiled CPU engine (numba) of the re-fit-objective swaps: the lazy state of
:mod:`~sparseswaps_prune.core.backends.refit_lazy` (``H`` and ``Z`` as a base plus pending rank-one terms, folded by
one BLAS product per row every ``factor_slots / 2`` moves; a restore's vector read off the shared Gram by one BLAS
product for all rows of a call) with its scan and moves compiled, row by row in parallel.

**The pair scan visits few columns.** Every swap's change satisfies ``dF(u, p) >= -r_p^2 / s_p`` (Cauchy-Schwarz, for
any stored values with ``s_p, H_uu > 0``), so pruned slots are visited in descending order of that restore gain and
the scan stops at the first one whose gain cannot beat the row's best swap (with a rounding margin, so no pair that
could win or tie is skipped). Each visited column ``Z[:, p]`` is formed from ``Z0`` and the pending terms.

Every pair visited is evaluated in float64 with the formula and operation order of
:func:`~sparseswaps_prune.core.backends.refit_state.scan_swaps` (no fused multiply-add), ties to the smallest ``u`` then
``p`` (input indices), so the chosen swap is the float64 argmin over all pairs -- the same one as the torch scan and
the brute force, up to the rounding differences of the state (the state is float64 in both, updated in a different
order). The scan works on few columns per row, so a float32 pre-scan would not pay: it is not used.

Slots, vacancy, the pivot floor and exact-zero weights follow :mod:`~sparseswaps_prune.core.backends.refit_state`.
"""

from __future__ import annotations

import numba as nb
import numpy as np
import torch

from sparseswaps_prune.core.backends.numba_search import min_key64
from sparseswaps_prune.core.backends.refit_lazy import LazyRefitState
from sparseswaps_prune.core.backends.refit_state import SKIP_RTOL

_SWAP, _REMOVE, _ADD = 0, 1, 2


@nb.njit(cache=True)
def _column(zt, fa, fb, rank, r, j, out):  # pragma: no cover - compiled
    """``out = Z[:, j]`` of row ``r`` (base column plus pending terms)."""
    k_slots = out.shape[0]
    for i in range(k_slots):
        out[i] = zt[r, j, i]
    for k in range(rank):
        b = fb[r, k, j]
        if b != 0.0:
            for i in range(k_slots):
                out[i] += fa[r, k, i] * b


@nb.njit(parallel=True, cache=True)
def _scan(
    rows, w, kept, kept_ok, pruned, pruned_ok, hdiag, coef, resid, schur, zt, fa, fb, rank, floor, m,
    out_dl, out_i, out_j, out_cols,
):  # pragma: no cover - compiled  # fmt: skip
    n = rows.shape[0]
    k_slots = kept.shape[1]
    q_slots = pruned.shape[1]
    d = w.shape[1]
    big = np.int64(1) << 62
    for e in nb.prange(n):
        r = rows[e]
        out_dl[e], out_i[e], out_j[e], out_cols[e] = np.inf, 0, 0, 0
        ratio = np.zeros(k_slots)
        remove = np.full(k_slots, np.inf)
        h_safe = np.ones(k_slots)
        rem_max = 0.0
        n_kept = 0
        bounded = True  # the skip bound needs H_uu > 0 (always, unless the state is broken)
        for i in range(k_slots):
            if kept_ok[r, i]:
                h = hdiag[r, i]
                h_safe[i] = h
                ratio[i] = coef[r, i] / h
                remove[i] = coef[r, i] * ratio[i]
                rem_max = max(rem_max, abs(remove[i]))
                n_kept += 1
                if not h > 0:
                    bounded = False
        neg_gain = np.empty(q_slots)
        cand = np.empty(q_slots, np.int64)
        n_cand = 0
        for j in range(q_slots):
            if pruned_ok[r, j] and w[r, pruned[r, j]] != 0:
                s = schur[r, j]
                neg_gain[n_cand] = -(resid[r, j] * resid[r, j] / s) if (s > 0 and bounded) else -np.inf
                cand[n_cand] = j
                n_cand += 1
        if n_kept == 0 or n_cand == 0:
            continue
        slot_of = np.full(d if m > 0 else 0, -1, np.int64)
        for i in range(k_slots):
            if m > 0 and kept_ok[r, i]:
                slot_of[kept[r, i]] = i
        order = np.argsort(neg_gain[:n_cand])  # largest gain first
        best, best_i, best_j, best_u, best_p = np.inf, 0, 0, big, big
        zcol = np.empty(k_slots)
        cost = np.empty(k_slots)
        visited = 0
        for t in range(n_cand):
            ng = neg_gain[order[t]]
            if ng > best + SKIP_RTOL * (rem_max - ng):
                break  # this and every later slot: dF >= -gain > best
            j = cand[order[t]]
            visited += 1
            p = pruned[r, j]
            s = schur[r, j]
            rr = resid[r, j]
            fl = floor[p]
            if m > 0:  # N:M: only the kept inputs of p's block
                b0 = (p // m) * m
                for q in range(b0, b0 + m):
                    i = slot_of[q]
                    if i < 0:
                        continue
                    z = zt[r, j, i]
                    for k in range(rank[r]):
                        z += fa[r, k, i] * fb[r, k, j]
                    piv = z * z / h_safe[i] + s
                    if not piv > fl:
                        continue
                    num = z * ratio[i] + rr
                    c = remove[i] - num * num / piv
                    u = kept[r, i]
                    if c < best or (c == best and (u < best_u or (u == best_u and p < best_p))):
                        best, best_i, best_j, best_u, best_p = c, i, j, u, p
                continue
            _column(zt, fa, fb, rank[r], r, j, zcol)
            for i in range(k_slots):
                z = zcol[i]
                piv = z * z / h_safe[i] + s
                num = z * ratio[i] + rr
                c = remove[i] - num * num / piv
                cost[i] = c if piv > fl else np.inf  # vacant slots: remove = inf
            low = min_key64(cost.view(np.int64))
            if low < best or (low == best and low < np.inf):
                for i in range(k_slots):
                    if cost[i] == low:
                        u = kept[r, i]
                        if low < best or u < best_u or (u == best_u and p < best_p):
                            best, best_i, best_j, best_u, best_p = low, i, j, u, p
        out_dl[e], out_i[e], out_j[e], out_cols[e] = best, best_i, best_j, visited


@nb.njit(cache=True)
def _remove(r, i, kept, kept_ok, inv, hdiag, coef, resid, schur, zt, fa, fc, fb, rank, zin):  # pragma: no cover
    """Prune the input of kept slot ``i`` of row ``r`` (see ``refit_state.remove_kept``); adds one pending term.
    Writes the pruned input's new ``Z`` column into ``zin`` and returns ``(u, r_u, s_u)``."""
    k_slots = kept.shape[1]
    q_slots = resid.shape[1]
    k = rank[r]
    hcol = np.empty(k_slots)
    for x in range(k_slots):
        hcol[x] = inv[r, i, x]
    for kk in range(k):
        weight = fc[r, kk] * fa[r, kk, i]
        if weight != 0.0:
            for x in range(k_slots):
                hcol[x] += weight * fa[r, kk, x]
    h_ii = hcol[i]
    ratio = coef[r, i] / h_ii
    zrow = np.empty(q_slots)
    for q in range(q_slots):
        zrow[q] = zt[r, q, i]
    for kk in range(k):
        a = fa[r, kk, i]
        if a != 0.0:
            for q in range(q_slots):
                zrow[q] += a * fb[r, kk, q]
    for x in range(k_slots):
        scaled = hcol[x] / -h_ii
        fa[r, k, x] = scaled
        hdiag[r, x] += hcol[x] * scaled
        coef[r, x] -= hcol[x] * ratio
    fc[r, k] = -h_ii
    for q in range(q_slots):
        fb[r, k, q] = zrow[q]
        resid[r, q] += zrow[q] * ratio
        schur[r, q] += zrow[q] * zrow[q] / h_ii
    rank[r] = k + 1
    for x in range(k_slots):
        zin[x] = fa[r, k, x]
        inv[r, i, x] = 0.0
        inv[r, x, i] = 0.0
    zin[i] = 0.0
    for kk in range(k + 1):
        fa[r, kk, i] = 0.0
    for q in range(q_slots):
        zt[r, q, i] = 0.0
    coef[r, i] = 0.0
    hdiag[r, i] = 0.0
    u = kept[r, i]
    kept[r, i] = 0
    kept_ok[r, i] = False
    return u, ratio, 1.0 / h_ii


@nb.njit(cache=True)
def _place(r, j, u, zin, r_in, s_in, filled, pruned, pruned_ok, resid, schur, zt, fb, rank):  # pragma: no cover
    """Write pruned input ``u`` (column ``zin``, ``r_u``, ``s_u``) into pruned slot ``j`` of row ``r``, or vacate the
    slot (``filled`` False)."""
    for x in range(zt.shape[2]):
        zt[r, j, x] = zin[x] if filled else 0.0
    for kk in range(rank[r]):
        fb[r, kk, j] = 0.0
    resid[r, j] = r_in if filled else 0.0
    schur[r, j] = s_in if filled else 1.0
    pruned[r, j] = u if filled else 0
    pruned_ok[r, j] = filled


@nb.njit(cache=True)
def _restore(r, dest, p, piv, ratio, y, acc, t, gram, kept, kept_ok, pruned, pruned_ok, hdiag, coef, resid, schur,
             fa, fc, fb, rank):  # pragma: no cover - compiled  # fmt: skip
    """Restore input ``p`` (pivot ``s_p``, re-fitted value ``ratio = r_p / s_p``, column ``y = Z[:, p]`` and
    ``acc = sum_{s in S} y_s G[s, :]``) into vacant kept slot ``dest`` of row ``r`` (see
    ``refit_state.add_pruned``); adds one pending term."""
    k_slots = kept.shape[1]
    q_slots = pruned.shape[1]
    for q in range(q_slots):  # t_q = G_pq - G[p, S] Z[:, q] = G_pq - y^T G[S, q]
        t[q] = gram[p, pruned[r, q]] - acc[pruned[r, q]] if pruned_ok[r, q] else 0.0
    y[dest] = -1.0
    k = rank[r]
    for x in range(k_slots):
        fa[r, k, x] = y[x]
        hdiag[r, x] += y[x] * (y[x] / piv)
        coef[r, x] -= y[x] * ratio
    fc[r, k] = 1.0 / piv
    for q in range(q_slots):
        fb[r, k, q] = t[q] / -piv
        resid[r, q] -= t[q] * ratio
        schur[r, q] -= t[q] * t[q] / piv
    rank[r] = k + 1
    kept[r, dest] = p
    kept_ok[r, dest] = True


@nb.njit(parallel=True, cache=True)
def _remove_all(
    rows, ops, slot_a, slot_b, kept, kept_ok, pruned, pruned_ok, inv, hdiag, coef, resid, schur, zt, fa, fc, fb,
    rank, y, spread, pivot, ratio, out_u, out_p,
):  # pragma: no cover - compiled  # fmt: skip
    """First pass of a call's moves (see :meth:`NumbaRefitState._moves`), one entry per (distinct) row: the removals
    of swaps and prunes, the placing of the pruned input, and for swaps and restores the restored input ``p``'s
    column ``y[e] = Z[:, p]``, its pivot ``s_p``, its re-fitted value ``r_p / s_p``, and ``y`` scattered to the kept
    inputs' positions (``spread[e]``, zero elsewhere). Writes the pruned and restored inputs (-1 where none)."""
    k_slots = kept.shape[1]
    for e in nb.prange(rows.shape[0]):
        r, op = rows[e], ops[e]
        out_u[e], out_p[e] = -1, -1
        zin = np.empty(k_slots)
        u, r_in, s_in = np.int64(0), 0.0, 1.0
        if op != _ADD:
            u, r_in, s_in = _remove(r, slot_a[e], kept, kept_ok, inv, hdiag, coef, resid, schur, zt, fa, fc, fb,
                                    rank, zin)  # fmt: skip
            out_u[e] = u
            if op == _REMOVE:
                _place(r, slot_b[e], u, zin, r_in, s_in, True, pruned, pruned_ok, resid, schur, zt, fb, rank)
                continue
        j = slot_b[e]
        _column(zt, fa, fb, rank[r], r, j, y[e])
        pivot[e] = schur[r, j]
        ratio[e] = resid[r, j] / pivot[e]  # the restored weight's re-fitted value
        out_p[e] = pruned[r, j]
        _place(r, j, u, zin, r_in, s_in, op == _SWAP, pruned, pruned_ok, resid, schur, zt, fb, rank)
        for i in range(k_slots):
            if kept_ok[r, i]:
                spread[e, kept[r, i]] = y[e, i]


@nb.njit(parallel=True, cache=True)
def _restore_all(
    rows, ops, slot_a, gram, kept, kept_ok, pruned, pruned_ok, hdiag, coef, resid, schur, fa, fc, fb, rank, y,
    products, pivot, ratio, out_p,
):  # pragma: no cover - compiled  # fmt: skip
    """Second pass: the restores of swaps and restores, with ``products[e] = spread[e] @ G`` (``= sum_{s in S} y_s
    G[s, :]``)."""
    q_slots = pruned.shape[1]
    for e in nb.prange(rows.shape[0]):
        if ops[e] != _REMOVE:
            t = np.empty(q_slots)
            _restore(rows[e], slot_a[e], out_p[e], pivot[e], ratio[e], y[e], products[e], t, gram, kept, kept_ok,
                     pruned, pruned_ok, hdiag, coef, resid, schur, fa, fc, fb, rank)  # fmt: skip


class NumbaRefitState(LazyRefitState):
    """The lazy re-fit state (:class:`~sparseswaps_prune.core.backends.refit_lazy.LazyRefitState`: attributes,
    arguments, build, fold, grow) on CPU tensors, with its scan and moves compiled (the kernels work on the tensors'
    numpy views, in place). Rows fold their pending terms one by one when they would overflow.

    Raises:
        ValueError: tensors off the CPU, a bad ``factor_slots``, or a singular ``G_SS + lambda I`` (names the rows).
    """

    def __init__(self, w64: torch.Tensor, *args, **kwargs) -> None:
        """Arguments as :class:`~sparseswaps_prune.core.backends.refit_lazy.LazyRefitState`'s (CPU tensors)."""
        if w64.device.type != "cpu":
            raise ValueError(f"the numba re-fit engine runs on the CPU; got tensors on {w64.device}")
        self.visited = 0  # pruned columns visited by the scans so far (statistics)
        super().__init__(w64, *args, **kwargs)

    def scan(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Best swap of every row in ``rows`` (``[n]`` int64): ``dF`` ``[n]`` float64 (``+inf`` where no feasible
        pair), kept slot and pruned slot ``[n]`` int64; as :func:`~.refit_state.scan_swaps`."""
        n = rows.numel()
        dl = np.empty(n)
        slot_i, slot_j, cols = np.empty(n, np.int64), np.empty(n, np.int64), np.empty(n, np.int64)
        _scan(
            rows.contiguous().numpy(), self.w64.numpy(), self.kept.numpy(), self.kept_ok.numpy(),
            self.pruned.numpy(), self.pruned_ok.numpy(), self.hdiag.numpy(), self.coef.numpy(), self.resid.numpy(),
            self.schur.numpy(), self.zt.numpy(), self.fa.numpy(), self.fb.numpy(), self.rank.numpy(),
            self.floor.numpy(), self.m or 0, dl, slot_i, slot_j, cols,
        )  # fmt: skip
        self.visited += int(cols.sum())
        return torch.from_numpy(dl), torch.from_numpy(slot_i), torch.from_numpy(slot_j)

    def _moves(self, op: int, rows: torch.Tensor, slot_a: torch.Tensor, slot_b: torch.Tensor):
        """Apply one move ``op`` to each of the distinct ``rows`` (``[n]`` int64), in place: ``_SWAP`` kept slot
        ``slot_a`` with pruned slot ``slot_b``; ``_REMOVE`` kept slot ``slot_a`` into vacant pruned slot ``slot_b``;
        ``_ADD`` pruned slot ``slot_b`` into vacant kept slot ``slot_a``. Rows whose pending terms would overflow
        are folded first. Three passes: :func:`_remove_all`, one BLAS product ``spread @ G`` of every restore's
        column, :func:`_restore_all`. Returns the pruned and the restored inputs ``[n]`` int64 (-1 where none)."""
        n = rows.numel()
        out_u, out_p = np.empty(n, np.int64), np.empty(n, np.int64)
        if n == 0:
            return torch.from_numpy(out_u), torch.from_numpy(out_p)
        self.fold(rows[self.rank[rows] + 2 > self.factor_slots])
        k_slots = self.slots[0]
        restores = n if op != _REMOVE else 0  # a removal never reads its restore buffers
        y, spread = np.zeros((restores, k_slots)), torch.zeros(restores, self.gram64.shape[0], dtype=torch.float64)
        pivot, ratio = np.ones(n), np.zeros(n)
        rows_np, ops = rows.contiguous().numpy(), np.full(n, op, np.int64)
        slot_a_np = slot_a.contiguous().numpy()
        kept, kept_ok, pruned, pruned_ok = (t.numpy() for t in (self.kept, self.kept_ok, self.pruned, self.pruned_ok))
        hdiag, coef, resid, schur = (t.numpy() for t in (self.hdiag, self.coef, self.resid, self.schur))
        fa, fc, fb, rank = (t.numpy() for t in (self.fa, self.fc, self.fb, self.rank))
        _remove_all(
            rows_np, ops, slot_a_np, slot_b.contiguous().numpy(), kept, kept_ok, pruned, pruned_ok, self.inv.numpy(),
            hdiag, coef, resid, schur, self.zt.numpy(), fa, fc, fb, rank, y, spread.numpy(), pivot, ratio, out_u,
            out_p,
        )  # fmt: skip
        if op != _REMOVE:
            products = (spread @ self.gram64).numpy()  # one BLAS pass over G for all restores of the call
            _restore_all(
                rows_np, ops, slot_a_np, self.gram64.numpy(), kept, kept_ok, pruned, pruned_ok, hdiag, coef, resid,
                schur, fa, fc, fb, rank, y, products, pivot, ratio, out_p,
            )  # fmt: skip
        self.max_rank = int(self.rank.max())  # the torch reads of the lazy state slice the terms by it
        return torch.from_numpy(out_u), torch.from_numpy(out_p)

    def swap(self, rows: torch.Tensor, slot_i: torch.Tensor, slot_j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Swap kept slot ``slot_i`` and pruned slot ``slot_j`` of each (distinct) row; returns the inputs
        ``(u, p)`` (as :func:`~sparseswaps_prune.core.backends.refit_state.swap_slots`)."""
        return self._moves(_SWAP, rows, slot_i, slot_j)

    def remove(self, rows: torch.Tensor, slot_i: torch.Tensor, vacant_j: torch.Tensor) -> torch.Tensor:
        """Prune kept slot ``slot_i`` of each row into its vacant pruned slot ``vacant_j``; returns the inputs."""
        return self._moves(_REMOVE, rows, slot_i, vacant_j)[0]

    def add(self, rows: torch.Tensor, slot_j: torch.Tensor, vacant_i: torch.Tensor) -> torch.Tensor:
        """Restore pruned slot ``slot_j`` of each row into its vacant kept slot ``vacant_i`` (the pruned slot
        becomes vacant); returns the inputs."""
        return self._moves(_ADD, rows, vacant_i, slot_j)[1]
