"""The lazy re-fit state's moves in two Triton kernels (CUDA, or CPU tensors in the Triton interpreter): the
per-row work of :class:`~sparseswaps_prune.core.backends.refit_lazy.LazyRefitState`'s swaps, removals and restores
without its dozens of small torch operations per call (each a launch and a pass over ``[n, K]`` or ``[n, Q]``).

One program per row, in phases separated by barriers (a phase reads what the one before wrote, and no warp
overwrites a scalar another may not have read yet):

* :func:`_remove_kernel` -- the removal of a kept slot (the column ``H[:, u]`` and the row ``Z[u, :]`` through the
  pending terms, the updates of ``diag H``, ``v``, ``r``, ``s``, the new pending term, the slot vacated), then for a
  swap or a restore the column ``y = Z[:, p]`` of the pruned slot to restore (written out, and spread over the
  kept inputs' positions for the product with the Gram), then the pruned slot refilled with the removed input
  (swap, removal) or vacated (restore);
* ``spread @ G`` in torch (one product for all rows of the call);
* :func:`_restore_kernel` -- the restore: ``t_q = G_pq - (y^T G[S, :])_q``, the updates and the second pending term.

The operations are those of :mod:`~sparseswaps_prune.core.backends.refit_numba` in its order, compiled without fused
multiply-add; the state is the torch moves' up to rounding (tests: the same swaps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

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
    out_u, out_p = (torch.full((n,), -1, dtype=torch.long, device=dev) for _ in range(2))
    if n == 0:
        return out_u, out_p
    (k_slots, q_slots), d = state.slots, state.gram64.shape[0]
    restores = mode != REMOVE
    y = torch.empty(n if restores else 1, k_slots, dtype=torch.float64, device=dev)
    spread = torch.zeros(n if restores else 1, d, dtype=torch.float64, device=dev)
    pivot = torch.ones(n, dtype=torch.float64, device=dev)
    ratio = torch.zeros(n, dtype=torch.float64, device=dev)
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
