"""The lazy re-fit state's moves in two Triton kernels and its scan's terms in a third (CUDA, or CPU tensors in the
Triton interpreter): the per-row work of :class:`~sparseswaps_prune.core.backends.refit_lazy.LazyRefitState`'s swaps,
removals and restores, and of the prologue of :func:`refit_triton.scan_swaps`, without their dozens of small torch
operations per call (each a launch and a pass over ``[n, K]`` or ``[n, Q]``).

One program per row, in phases separated by barriers (a phase reads what the one before wrote, and no warp
overwrites a scalar another may not have read yet):

* :func:`_remove_kernel` -- the removal of a kept slot (the column ``H[:, u]`` and the row ``Z[u, :]`` through the
  pending terms, the updates of ``diag H``, ``v``, ``r``, ``s``, the new pending term, the slot vacated), then for a
  swap or a restore the column ``y = Z[:, p]`` of the pruned slot to restore (written out, and spread over the
  kept inputs' positions for the product with the Gram), then the pruned slot refilled with the removed input
  (swap, removal) or vacated (restore);
* ``spread @ G`` in torch (one product for all rows of the call);
* :func:`_restore_kernel` -- the restore: ``t_q = G_pq - (y^T G[S, :])_q``, the updates and the second pending term.

:func:`scan_terms` (:func:`_prologue_kernel`, one program per row) writes the terms the scan kernel reads and the
slots it must evaluate, as ``refit_triton.columns_to_scan`` chooses them, and with N:M the kept slots each tile of
pruned slots pairs with (``refit_triton.kept_slot_ranges``, by binary searches over the row's kept blocks).

The operations are those of :mod:`~sparseswaps_prune.core.backends.refit_numba` in its order, compiled without fused
multiply-add; the state is the torch moves' up to rounding (tests: the same swaps; the scan's terms bit for bit).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from sparseswaps_prune.core.backends.refit_triton import pair_cost
from sparseswaps_prune.core.refit_swaps import SKIP_RTOL

# Elements of K or Q per block of a row's program.
MOVE_BLOCK = 128
MOVE_WARPS = 4

SWAP, REMOVE, ADD = 0, 1, 2


@triton.jit
def _remove_kernel(
    rows_ptr, slot_a_ptr, slot_b_ptr, kept_ptr, kept_ok_ptr, pruned_ptr, pruned_ok_ptr, inv_ptr, hdiag_ptr, coef_ptr,
    resid_ptr, schur_ptr, zt_ptr, fa_ptr, fc_ptr, fb_ptr, rank_ptr, y_ptr, spread_ptr, pivot_ptr, ratio_ptr,
    out_u_ptr, out_p_ptr, K, Q, F, d, MODE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Program ``e``: row ``rows[e]``; ``slot_a``: the kept slot to prune (``MODE`` SWAP, REMOVE) or the vacant kept
    slot (ADD, unused here); ``slot_b``: the pruned slot to restore (SWAP, ADD) or the vacant one to fill (REMOVE).
    Writes ``y[e]`` (``[K]``), ``spread[e]`` (``[d]``, zeros on entry), ``pivot[e]``, ``ratio[e]``, ``out_u[e]``,
    ``out_p[e]`` (-1 where none)."""
    e = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + e)
    j = tl.load(slot_b_ptr + e)
    k = tl.load(rank_ptr + r)
    fa_row = fa_ptr + r * F * K
    fb_row = fb_ptr + r * F * Q
    zt_row = zt_ptr + r * Q * K
    ks = tl.arange(0, BLOCK)
    h_ii = 1.0
    ratio_u = 0.0
    u = 0
    if MODE != 2:  # prune kept slot i: one pending term (fa_k = H[:, u] / -H_uu, fc_k = -H_uu, fb_k = Z[u, :])
        i = tl.load(slot_a_ptr + e)
        h_ii = tl.load(inv_ptr + r * K * K + i * K + i)
        for t in range(k):
            a_i = tl.load(fa_row + t * K + i)
            h_ii += tl.load(fc_ptr + r * F + t) * a_i * a_i
        ratio_u = tl.load(coef_ptr + r * K + i) / h_ii
        u = tl.load(kept_ptr + r * K + i)
        tl.debug_barrier()  # every warp has read its scalars before any writes v_u (coef) below
        for x0 in range(0, K, BLOCK):
            x = x0 + ks
            x_in = x < K
            h = tl.load(inv_ptr + r * K * K + i * K + x, mask=x_in, other=0.0)
            for t in range(k):
                weight = tl.load(fc_ptr + r * F + t) * tl.load(fa_row + t * K + i)
                h += weight * tl.load(fa_row + t * K + x, mask=x_in, other=0.0)
            scaled = h / -h_ii
            hd = tl.load(hdiag_ptr + r * K + x, mask=x_in, other=0.0)
            tl.store(hdiag_ptr + r * K + x, hd + h * scaled, mask=x_in)
            cf = tl.load(coef_ptr + r * K + x, mask=x_in, other=0.0)
            tl.store(coef_ptr + r * K + x, cf - h * ratio_u, mask=x_in)
            tl.store(fa_row + k * K + x, scaled, mask=x_in)
        for q0 in range(0, Q, BLOCK):
            q = q0 + ks
            q_in = q < Q
            z = tl.load(zt_row + q * K + i, mask=q_in, other=0.0)
            for t in range(k):
                z += tl.load(fa_row + t * K + i) * tl.load(fb_row + t * Q + q, mask=q_in, other=0.0)
            rs_ = tl.load(resid_ptr + r * Q + q, mask=q_in, other=0.0)
            tl.store(resid_ptr + r * Q + q, rs_ + z * ratio_u, mask=q_in)
            sc = tl.load(schur_ptr + r * Q + q, mask=q_in, other=0.0)
            tl.store(schur_ptr + r * Q + q, sc + z * z / h_ii, mask=q_in)
            tl.store(fb_row + k * Q + q, z, mask=q_in)
        tl.debug_barrier()  # every read of row and column i is done: vacate the slot
        for x0 in range(0, K, BLOCK):
            x = x0 + ks
            x_in = x < K
            tl.store(inv_ptr + r * K * K + i * K + x, tl.zeros([BLOCK], tl.float64), mask=x_in)
            tl.store(inv_ptr + r * K * K + x * K + i, tl.zeros([BLOCK], tl.float64), mask=x_in)
        for q0 in range(0, Q, BLOCK):
            q = q0 + ks
            tl.store(zt_row + q * K + i, tl.zeros([BLOCK], tl.float64), mask=q < Q)
        for t0 in range(0, k + 1, BLOCK):  # every term's entry i, the new one's included
            term = t0 + ks
            tl.store(fa_row + term * K + i, tl.zeros([BLOCK], tl.float64), mask=term <= k)
        tl.store(fc_ptr + r * F + k, -h_ii)
        tl.store(coef_ptr + r * K + i, 0.0)
        tl.store(hdiag_ptr + r * K + i, 0.0)
        tl.store(kept_ptr + r * K + i, 0)
        tl.store(kept_ok_ptr + r * K + i, 0)
        k = k + 1
        tl.store(rank_ptr + r, k)
        tl.debug_barrier()
    if MODE != 1:  # y = Z[:, j] through the terms (zero at vacant kept slots), its pivot and re-fitted value
        pivot = tl.load(schur_ptr + r * Q + j)
        tl.store(pivot_ptr + e, pivot)
        tl.store(ratio_ptr + e, tl.load(resid_ptr + r * Q + j) / pivot)
        tl.store(out_p_ptr + e, tl.load(pruned_ptr + r * Q + j))
        for x0 in range(0, K, BLOCK):
            x = x0 + ks
            x_in = x < K
            y = tl.load(zt_row + j * K + x, mask=x_in, other=0.0)
            for t in range(k):
                y += tl.load(fa_row + t * K + x, mask=x_in, other=0.0) * tl.load(fb_row + t * Q + j)
            tl.store(y_ptr + e * K + x, y, mask=x_in)
            ok = x_in & (tl.load(kept_ok_ptr + r * K + x, mask=x_in, other=0) != 0)
            tl.store(spread_ptr + e * d + tl.load(kept_ptr + r * K + x, mask=ok, other=0), y, mask=ok)
        tl.debug_barrier()
    else:
        tl.store(out_p_ptr + e, -1)
    # pruned slot j: the removed input u (column fa_{k-1} = H[:, u] / -H_uu, zero at i), or vacant (restore)
    filled = MODE != 2
    for x0 in range(0, K, BLOCK):
        x = x0 + ks
        x_in = x < K
        column = tl.zeros([BLOCK], tl.float64)
        if filled:
            column = tl.load(fa_row + (k - 1) * K + x, mask=x_in, other=0.0)
        tl.store(zt_row + j * K + x, column, mask=x_in)
    for t0 in range(0, k, BLOCK):
        term = t0 + ks
        tl.store(fb_row + term * Q + j, tl.zeros([BLOCK], tl.float64), mask=term < k)
    if filled:
        tl.store(out_u_ptr + e, u)
        tl.store(resid_ptr + r * Q + j, ratio_u)
        tl.store(schur_ptr + r * Q + j, 1.0 / h_ii)
        tl.store(pruned_ptr + r * Q + j, u)
        tl.store(pruned_ok_ptr + r * Q + j, 1)
    else:
        tl.store(out_u_ptr + e, -1)
        tl.store(resid_ptr + r * Q + j, 0.0)
        tl.store(schur_ptr + r * Q + j, 1.0)
        tl.store(pruned_ptr + r * Q + j, 0)
        tl.store(pruned_ok_ptr + r * Q + j, 0)


@triton.jit
def _restore_kernel(
    rows_ptr, dest_ptr, gram_ptr, products_ptr, kept_ptr, kept_ok_ptr, pruned_ptr, pruned_ok_ptr, hdiag_ptr, coef_ptr,
    resid_ptr, schur_ptr, fa_ptr, fc_ptr, fb_ptr, rank_ptr, y_ptr, pivot_ptr, ratio_ptr, p_ptr, K, Q, F, d,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Program ``e``: restore input ``p[e]`` (column ``y[e]``, ``pivot[e]``, ``ratio[e]`` from
    :func:`_remove_kernel`, ``products[e] = spread[e] @ G``) into vacant kept slot ``dest[e]`` of row ``rows[e]``:
    one pending term (``fa_k = y`` with -1 at ``dest``, ``fc_k = 1 / s_p``, ``fb_k = t / -s_p``)."""
    e = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + e)
    dest = tl.load(dest_ptr + e)
    p = tl.load(p_ptr + e)
    pivot = tl.load(pivot_ptr + e)
    ratio = tl.load(ratio_ptr + e)
    k = tl.load(rank_ptr + r)
    ks = tl.arange(0, BLOCK)
    for q0 in range(0, Q, BLOCK):
        q = q0 + ks
        q_in = q < Q
        ok = q_in & (tl.load(pruned_ok_ptr + r * Q + q, mask=q_in, other=0) != 0)
        pq = tl.load(pruned_ptr + r * Q + q, mask=ok, other=0)
        t = tl.load(gram_ptr + p * d + pq, mask=ok, other=0.0) - tl.load(products_ptr + e * d + pq, mask=ok, other=0.0)
        t = tl.where(ok, t, 0.0)
        tl.store(fb_ptr + (r * F + k) * Q + q, t / -pivot, mask=q_in)
        rs_ = tl.load(resid_ptr + r * Q + q, mask=q_in, other=0.0)
        tl.store(resid_ptr + r * Q + q, rs_ - t * ratio, mask=q_in)
        sc = tl.load(schur_ptr + r * Q + q, mask=q_in, other=0.0)
        tl.store(schur_ptr + r * Q + q, sc - t * t / pivot, mask=q_in)
    for x0 in range(0, K, BLOCK):
        x = x0 + ks
        x_in = x < K
        y = tl.load(y_ptr + e * K + x, mask=x_in, other=0.0)
        y = tl.where(x == dest, -1.0, y)
        tl.store(fa_ptr + (r * F + k) * K + x, y, mask=x_in)
        hd = tl.load(hdiag_ptr + r * K + x, mask=x_in, other=0.0)
        tl.store(hdiag_ptr + r * K + x, hd + y * (y / pivot), mask=x_in)
        cf = tl.load(coef_ptr + r * K + x, mask=x_in, other=0.0)
        tl.store(coef_ptr + r * K + x, cf - y * ratio, mask=x_in)
    tl.debug_barrier()  # every warp has read the rank before it changes
    tl.store(fc_ptr + r * F + k, 1.0 / pivot)
    tl.store(rank_ptr + r, k + 1)
    tl.store(kept_ptr + r * K + dest, p)
    tl.store(kept_ok_ptr + r * K + dest, 1)


def moves(state, mode: int, rows: torch.Tensor, slot_a: torch.Tensor, slot_b: torch.Tensor):
    """Apply move ``mode`` (:data:`SWAP`, :data:`REMOVE`, :data:`ADD`) to each of the distinct ``rows`` of the lazy
    ``state`` (``[n]`` int64; ``slot_a`` kept slots, ``slot_b`` pruned slots as in ``LazyRefitState``), in place.
    The caller makes room for the pending terms. Returns the pruned and the restored inputs ``[n]`` int64 (-1 where
    none). Extra memory: ``[n, K]`` and ``[n, d]`` float64."""
    n = rows.numel()
    dev = rows.device
    out_u, out_p = (torch.empty(n, dtype=torch.long, device=dev) for _ in range(2))  # written by the kernel
    if n == 0:
        return out_u, out_p
    (k_slots, q_slots), d = state.slots, state.gram64.shape[0]
    restores = mode != REMOVE
    y = torch.empty(n if restores else 1, k_slots, dtype=torch.float64, device=dev)
    spread = torch.zeros(n if restores else 1, d, dtype=torch.float64, device=dev)
    pivot, ratio = (torch.empty(n, dtype=torch.float64, device=dev) for _ in range(2))  # written where restored
    rows, slot_a, slot_b = (t.contiguous() for t in (rows, slot_a, slot_b))
    kept_ok, pruned_ok = state.kept_ok.view(torch.uint8), state.pruned_ok.view(torch.uint8)
    common = dict(BLOCK=MOVE_BLOCK, num_warps=MOVE_WARPS, enable_fp_fusion=False)
    _remove_kernel[(n,)](
        rows, slot_a, slot_b, state.kept, kept_ok, state.pruned, pruned_ok, state.inv, state.hdiag, state.coef,
        state.resid, state.schur, state.zt, state.fa, state.fc, state.fb, state.rank, y, spread, pivot, ratio,
        out_u, out_p, k_slots, q_slots, state.factor_slots, d, MODE=mode, **common,
    )  # fmt: skip
    if restores:
        products = spread @ state.gram64  # sum_{s in S} y_s G[s, :] for every restore of the call
        _restore_kernel[(n,)](
            rows, slot_a, state.gram64, products, state.kept, kept_ok, state.pruned, pruned_ok, state.hdiag,
            state.coef, state.resid, state.schur, state.fa, state.fc, state.fb, state.rank, y, pivot, ratio, out_p,
            k_slots, q_slots, state.factor_slots, d, **common,
        )  # fmt: skip
    return out_u, out_p


# kept_slot_ranges' block of a vacant kept slot (and of a tile without scanned slots): above every block.
VACANT_BLOCK: tl.constexpr = tl.constexpr(2147483647)


@triton.jit
def _kept_block(kept_row, kept_ok_row, slot, mask, M: tl.constexpr):
    """The N:M block (``kept // M``) of a row's kept slots ``slot`` where ``mask`` and occupied, else
    :data:`VACANT_BLOCK`."""
    ok = mask & (tl.load(kept_ok_row + slot, mask=mask, other=0) != 0)
    return tl.where(ok, tl.load(kept_row + slot, mask=mask, other=0) // M, VACANT_BLOCK)


@triton.jit
def _halve(kept_row, kept_ok_row, first, end, target, M: tl.constexpr, RIGHT: tl.constexpr):
    """One halving of binary searches (one per lane) over a row's kept blocks (:func:`_kept_block`, vacant slots
    last): the first slot in ``[first, end)`` whose block is ``>= target`` (``> target`` with ``RIGHT``), as
    ``torch.searchsorted``; returns the new ``(first, end)``."""
    active = first < end
    mid = (first + end) // 2
    block = _kept_block(kept_row, kept_ok_row, mid, active, M)
    if RIGHT:
        after = active & (block <= target)
    else:
        after = active & (block < target)
    return tl.where(after, mid + 1, first), tl.where(active & ~after, mid, end)


@triton.jit
def _prologue_kernel(
    rows_ptr, kept_ptr, kept_ok_ptr, pruned_ptr, pruned_ok_ptr, hdiag_ptr, coef_ptr, resid_ptr, schur_ptr, w_ptr,
    floor_ptr, zt_ptr, fa_ptr, fb_ptr, rank_ptr, skip_ptr, ratio_out, h_out, remove_out, kept_out, kept_ok_out,
    resid_out, schur_out, pruned_out, ok_out, floor_out, need_out, gain_ptr, k_lo_out, k_hi_out, K, Q, F, d, n_tiles,
    steps, M: tl.constexpr, C: tl.constexpr, BLOCK: tl.constexpr, TILE_Q: tl.constexpr, TILE_BLOCK: tl.constexpr,
):  # fmt: skip
    """Program ``e``: the scan's terms of row ``rows[e]`` as ``refit_triton.scan_swaps`` gathers them
    (``refit_swaps.removal_terms``, ``restorable``, the pivot floor of each pruned slot) into ``[n, K]`` and
    ``[n, Q]`` outputs, and ``need``: ``refit_triton.columns_to_scan`` with the costs of the row's ``C`` columns of
    largest restore gain (``gain``: ``[n, Q]`` scratch). With N:M (``M > 0``) also ``k_lo``, ``k_hi``
    (``[n, n_tiles]``): ``refit_triton.kept_slot_ranges`` for tiles of ``TILE_Q`` pruned slots, by binary searches
    of ``steps`` halvings over the row's kept blocks (``TILE_BLOCK``: a multiple of ``TILE_Q``)."""
    e = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + e)
    n_terms = tl.load(rank_ptr + r)
    skip_rtol = tl.load(skip_ptr)
    ks = tl.arange(0, BLOCK)
    rem_max = tl.zeros([BLOCK], tl.float64)
    broken = tl.zeros([BLOCK], tl.int32)
    descents = tl.zeros([BLOCK], tl.int32)  # N:M: kept slots whose block is below the previous slot's
    for x0 in range(0, K, BLOCK):  # removal_terms, as the reference
        x = x0 + ks
        x_in = x < K
        ok = x_in & (tl.load(kept_ok_ptr + r * K + x, mask=x_in, other=0) != 0)
        h = tl.where(ok, tl.load(hdiag_ptr + r * K + x, mask=x_in, other=1.0), 1.0)
        coef = tl.load(coef_ptr + r * K + x, mask=x_in, other=0.0)
        ratio = coef / h
        remove = coef * ratio
        tl.store(ratio_out + e * K + x, ratio, mask=x_in)
        tl.store(h_out + e * K + x, h, mask=x_in)
        tl.store(remove_out + e * K + x, remove, mask=x_in)
        tl.store(kept_out + e * K + x, tl.load(kept_ptr + r * K + x, mask=x_in, other=0), mask=x_in)
        tl.store(kept_ok_out + e * K + x, ok.to(tl.int8), mask=x_in)
        rem_max = tl.maximum(rem_max, tl.where(ok, tl.abs(remove), 0.0))
        broken += (ok & ~(h > 0)).to(tl.int32)
        if M > 0:
            block = _kept_block(kept_ptr + r * K, kept_ok_ptr + r * K, x, x_in, M)
            block_next = _kept_block(kept_ptr + r * K, kept_ok_ptr + r * K, x + 1, x + 1 < K, M)
            descents += ((x + 1 < K) & (block_next < block)).to(tl.int32)
    rem_top = tl.max(rem_max, axis=0)
    bounded = tl.sum(broken, axis=0) == 0
    for q0 in range(0, Q, BLOCK):  # restorable slots and their restore gains -r_p^2 / s_p
        q = q0 + ks
        q_in = q < Q
        p = tl.load(pruned_ptr + r * Q + q, mask=q_in, other=0)
        slot_ok = q_in & (tl.load(pruned_ok_ptr + r * Q + q, mask=q_in, other=0) != 0)
        ok = slot_ok & (tl.load(w_ptr + r * d + p, mask=slot_ok, other=0.0) != 0)
        resid = tl.load(resid_ptr + r * Q + q, mask=q_in, other=0.0)
        schur = tl.load(schur_ptr + r * Q + q, mask=q_in, other=1.0)
        positive = ok & (schur > 0)
        gain = tl.where(positive, -(resid * resid) / tl.where(positive, schur, 1.0), float("inf"))
        gain = tl.where(ok & ~positive, -float("inf"), gain)
        tl.store(gain_ptr + e * Q + q, gain, mask=q_in)
        tl.store(resid_out + e * Q + q, resid, mask=q_in)
        tl.store(schur_out + e * Q + q, schur, mask=q_in)
        tl.store(pruned_out + e * Q + q, p, mask=q_in)
        tl.store(ok_out + e * Q + q, ok.to(tl.int8), mask=q_in)
        tl.store(floor_out + e * Q + q, tl.load(floor_ptr + p, mask=q_in, other=0.0), mask=q_in)
    tl.debug_barrier()  # the gains are read back below
    reached = tl.full([BLOCK], float("inf"), tl.float64)  # per lane, reduced at the end
    last_gain = -float("inf")
    last_slot = -1
    for _c in tl.static_range(C):  # the next column of largest restore gain (smallest -gain, then slot)
        lane_gain = tl.full([BLOCK], float("inf"), tl.float64)
        lane_slot = tl.full([BLOCK], Q, tl.int32)
        for q0 in range(0, Q, BLOCK):
            q = q0 + ks
            gain = tl.load(gain_ptr + e * Q + q, mask=q < Q, other=float("inf"))
            later = (gain > last_gain) | ((gain == last_gain) & (q > last_slot))  # after the columns taken
            gain = tl.where(later & (q < Q), gain, float("inf"))
            take = gain < lane_gain  # slots ascend along a lane: ties keep the smaller
            lane_slot = tl.where(take, q, lane_slot)
            lane_gain = tl.where(take, gain, lane_gain)
        best_gain = tl.min(lane_gain, axis=0)
        best_slot = tl.min(tl.where(lane_gain == best_gain, lane_slot, Q), axis=0)
        if best_slot < Q:  # its pair costs over the kept slots (Z's column through the pending terms)
            p_j = tl.load(pruned_ptr + r * Q + best_slot)
            schur_j = tl.load(schur_ptr + r * Q + best_slot)
            resid_j = tl.load(resid_ptr + r * Q + best_slot)
            floor_j = tl.load(floor_ptr + p_j)
            j_ok = (tl.load(pruned_ok_ptr + r * Q + best_slot) != 0) & (tl.load(w_ptr + r * d + p_j) != 0)
            for x0 in range(0, K, BLOCK):  # the kept-slot terms again (fewer loads than reading them back)
                x = x0 + ks
                x_in = x < K
                ok = x_in & (tl.load(kept_ok_ptr + r * K + x, mask=x_in, other=0) != 0) & j_ok
                h = tl.where(ok, tl.load(hdiag_ptr + r * K + x, mask=x_in, other=1.0), 1.0)
                coef = tl.load(coef_ptr + r * K + x, mask=x_in, other=0.0)
                ratio = coef / h
                z = tl.load(zt_ptr + (r * Q + best_slot) * K + x, mask=x_in, other=0.0)
                for t in range(n_terms):
                    b = tl.load(fb_ptr + (r * F + t) * Q + best_slot)
                    z += tl.load(fa_ptr + (r * F + t) * K + x, mask=x_in, other=0.0) * b
                pivot, cost = pair_cost(z, h, ratio, coef * ratio, schur_j, resid_j)
                ok = ok & (pivot > floor_j)
                if M > 0:
                    ok = ok & (tl.load(kept_ptr + r * K + x, mask=x_in, other=0) // M == p_j // M)
                reached = tl.minimum(reached, tl.where(ok, cost, float("inf")))
        last_gain = best_gain
        last_slot = best_slot
    reached_row = tl.min(reached, axis=0)
    for q0 in range(0, Q, BLOCK):  # the slots whose bound -gain can reach the cost reached (NaN: scanned)
        q = q0 + ks
        q_in = q < Q
        gain = tl.load(gain_ptr + e * Q + q, mask=q_in, other=0.0)
        need = ~(gain > reached_row + skip_rtol * (rem_top - gain)) | ~bounded
        need = need & (tl.load(ok_out + e * Q + q, mask=q_in, other=0) != 0)
        tl.store(need_out + e * Q + q, need.to(tl.int8), mask=q_in)
    if M > 0:  # kept_slot_ranges: per tile, the kept slots of the blocks of its scanned slots
        tl.debug_barrier()  # need is read back below
        unsorted = tl.sum(descents, axis=0) > 0
        tile_lanes = tl.arange(0, TILE_BLOCK // TILE_Q)
        for q0 in range(0, Q, TILE_BLOCK):
            q = q0 + tl.arange(0, TILE_BLOCK)
            scanned = (q < Q) & (tl.load(need_out + e * Q + q, mask=q < Q, other=0) != 0)
            block = tl.load(pruned_ptr + r * Q + q, mask=scanned, other=0) // M
            lowest = tl.min(tl.reshape(tl.where(scanned, block, VACANT_BLOCK), [TILE_BLOCK // TILE_Q, TILE_Q]), axis=1)
            highest = tl.max(tl.reshape(tl.where(scanned, block, -1), [TILE_BLOCK // TILE_Q, TILE_Q]), axis=1)
            lo_first, lo_end = tl.zeros_like(tile_lanes), tl.zeros_like(tile_lanes) + K  # first kept block >= lowest
            hi_first, hi_end = tl.zeros_like(tile_lanes), tl.zeros_like(tile_lanes) + K  # first kept block > highest
            for _ in range(steps):
                lo_first, lo_end = _halve(kept_ptr + r * K, kept_ok_ptr + r * K, lo_first, lo_end, lowest, M, False)
                hi_first, hi_end = _halve(kept_ptr + r * K, kept_ok_ptr + r * K, hi_first, hi_end, highest, M, True)
            tile = q0 // TILE_Q + tile_lanes
            k_lo = tl.where(unsorted, 0, lo_first).to(tl.int64)
            k_hi = tl.where(unsorted, K, hi_first).to(tl.int64)
            tl.store(k_lo_out + e * n_tiles + tile, k_lo, mask=tile < n_tiles)
            tl.store(k_hi_out + e * n_tiles + tile, k_hi, mask=tile < n_tiles)


@cache
def _skip_rtol(device: torch.device) -> torch.Tensor:
    """``[1]`` float64 :data:`refit_swaps.SKIP_RTOL` on ``device`` (a float64 kernel argument; a Python float would
    pass as float32), copied there once instead of once per scan."""
    return torch.tensor([SKIP_RTOL], dtype=torch.float64, device=device)


def scan_terms(state, rows: torch.Tensor, threshold_columns: int, tile_q: int) -> list[torch.Tensor]:
    """The terms ``refit_triton.scan_swaps`` passes its kernel for rows ``rows`` of the lazy ``state``, in its
    order -- ``ratio``, ``h_safe``, ``remove``, ``kept``, ``kept_ok`` (int8), ``resid``, ``schur``, ``pruned``,
    restorable (int8), the pivot floor of each pruned slot, ``need`` (int8), and with N:M ``k_lo``, ``k_hi``
    (``refit_triton.kept_slot_ranges`` for tiles of ``tile_q`` pruned slots) -- from one kernel launch instead of
    the torch prologue's gathers, ``columns_to_scan`` (``threshold_columns`` columns set the threshold) and
    ``kept_slot_ranges``."""
    n, (k_slots, q_slots), d = rows.numel(), state.slots, state.w64.shape[1]

    def empty(slots: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, slots, dtype=dtype, device=rows.device)

    f64, i64, i8 = torch.float64, torch.long, torch.int8
    kept_side = [empty(k_slots, t) for t in (f64, f64, f64, i64, i8)]
    pruned_side = [empty(q_slots, t) for t in (f64, f64, i64, i8, f64, i8)]
    gain = empty(q_slots, f64)
    n_tiles = triton.cdiv(q_slots, tile_q)
    ranges = [empty(n_tiles, i64) for _ in range(2)] if state.m else [rows, rows]  # rows: unused stand-ins
    skip = _skip_rtol(rows.device)
    _prologue_kernel[(n,)](
        rows.contiguous(), state.kept, state.kept_ok.view(torch.uint8), state.pruned,
        state.pruned_ok.view(torch.uint8), state.hdiag, state.coef, state.resid, state.schur, state.w64,
        state.floor, state.zt, state.fa, state.fb, state.rank, skip, *kept_side, *pruned_side, gain, *ranges,
        k_slots, q_slots, state.factor_slots, d, n_tiles, k_slots.bit_length(), M=state.m or 0, C=threshold_columns,
        BLOCK=MOVE_BLOCK, TILE_Q=tile_q, TILE_BLOCK=max(MOVE_BLOCK, tile_q), num_warps=MOVE_WARPS,
        enable_fp_fusion=False,
    )  # fmt: skip
    return kept_side + pruned_side + (ranges if state.m else [])
