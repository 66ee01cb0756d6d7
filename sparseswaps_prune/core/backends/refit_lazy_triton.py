"""The re-fit objective's CUDA engine, :class:`TritonRefitState`: the lazy state of
:mod:`~sparseswaps_prune.core.backends.refit_lazy` with its scan and moves in Triton kernels (CPU tensors only in the
Triton interpreter, ``TRITON_INTERPRET=1``, for testing).

* The scan (:func:`scan_swaps`): :func:`_prologue_kernel` (:func:`scan_terms`, one program per row) writes the terms
  the scan reads -- ``refit_state.removal_terms``, the restorable slots, the pivot floors -- and the pruned slots it
  must evaluate: every pair's change satisfies ``dF(u, p) >= -r_p^2 / s_p`` (the numba engine's bound), so the costs
  of the row's ``THRESHOLD_COLUMNS`` columns of largest restore gain give a cost the scan reaches, and a slot whose
  bound exceeds it (by the rounding margin ``SKIP_RTOL``) cannot win or tie; with N:M also the kept slots each tile of
  pruned slots pairs with (by binary searches over the row's kept blocks). Then :func:`_scan_kernel` (one program
  per row and range of pruned slots) evaluates the pair costs
  ``v_u^2 / H_uu - (r_p + Z_up v_u / H_uu)^2 / (s_p + Z_up^2 / H_uu)`` tile by tile in registers, each tile of ``Z``
  read as ``Z0^T`` plus the row's pending terms, keeping the minimum and, on ties, the smallest input-index key
  ``u * d + p`` (the reference's tie rule); it neither reads nor evaluates the tiles the bound leaves out.
  :func:`best_slots` turns the programs' partial minima into slots.
* The moves (:func:`moves`), one program per row, in phases separated by barriers (a phase reads what the one
  before wrote, and no warp overwrites a scalar another may not have read yet): :func:`_remove_kernel` -- the
  removal of a kept slot (the column ``H[:, u]`` and the row ``Z[u, :]`` through the pending terms, the updates of
  ``diag H``, ``v``, ``r``, ``s``, the new pending term, the slot vacated), then for a swap or a restore the column
  ``y = Z[:, p]`` of the pruned slot to restore (written out, and spread over the kept inputs' positions for the
  product with the Gram), then the pruned slot refilled with the removed input (swap, removal) or vacated
  (restore); ``spread @ G`` in torch (one product for all rows of the call); :func:`_restore_kernel` -- the
  restore: ``t_q = G_pq - (y^T G[S, :])_q``, the updates and the second pending term.

Every kernel is compiled without fused multiply-add (``enable_fp_fusion=False``); the costs are evaluated with
:func:`refit_state.pair_costs`'s operations in its order and the moves with those of
:mod:`~sparseswaps_prune.core.backends.refit_numba` in its order. The state rounds differently from the torch
reference's; the engines choose the same swaps (tests: against the reference, and the prologue's terms bit for bit
against :func:`columns_to_scan` and :func:`kept_slot_ranges`).
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from sparseswaps_prune.core.backends.refit_lazy import LazyRefitState
from sparseswaps_prune.core.backends.refit_state import SKIP_RTOL, RefitState, no_swaps, pair_costs
from sparseswaps_prune.core.backends.triton_search import tile_splits

# (BLOCK_K, BLOCK_Q, num_warps) of the scan, on an H200 (BENCHMARKS.md, "Tile shapes of the pair scan";
# `benchmarks/refit_scan_tiles.py`): the scan is fastest with small tiles (16 x 32: 1.3 TB/s of Z against 0.8 TB/s at
# 4 x 256, before the bound skip).
SCAN_TILE = (16, 32, 4)
# Scan programs aimed for per streaming multiprocessor (a row's pruned slots are split to reach it; 4 to 32 made no
# consistent difference in the sweep).
SCAN_PROGRAMS_PER_SM = 4
# Columns of largest restore gain whose pair costs set a row's skip threshold (columns_to_scan): more than one, so
# that an N:M row's threshold comes from a pair its block allows (the N:M test layer asks for at most 12 of about
# 150 pruned slots per row to be evaluated).
THRESHOLD_COLUMNS = 4
# The engine's slot counts K and Q are rounded up to a multiple of this (vacant slots, at most d_in each):
# Triton specializes integer arguments divisible by 16, so with the row strides of H (K) and Z (Q) multiples of 16
# it can prove every row 16-byte aligned and emits 16-byte loads and stores (PTX ld/st.global.v2.b64) in the passes
# over H and Z instead of 8-byte ones (checked in the sm_90 PTX; A/B on a GPU: benchmarks/refit_swaps.py
# --slot-align 1).
SLOT_ALIGN = 16
# Slots per step of the kernel that turns the scan's partial minima into slots (_best_slots_kernel).
BEST_SLOTS_BLOCK = 256


def aligned_slots(n_slots: int, d: int) -> int:
    """``n_slots`` rounded up to a multiple of :data:`SLOT_ALIGN`, at most ``d`` (a state holds at most ``d`` slots
    of each kind)."""
    return min(d, -(-n_slots // SLOT_ALIGN) * SLOT_ALIGN)


@triton.jit
def pair_cost(z, h, ratio, remove, schur, resid):
    """``(pivot, cost)`` of pairs with ``Z`` entries ``z`` and the kept-slot (``h``, ``ratio``, ``remove``) and
    pruned-slot (``schur``, ``resid``) terms, broadcast: :func:`refit_state.pair_costs`'s operations in its order
    (no fma: launch with ``enable_fp_fusion=False``)."""
    pivot = z * z / h + schur
    t = z * ratio + resid
    return pivot, remove - t * t / pivot


@triton.jit
def _fold_costs(z, ok, ratio, h, remove, kept, resid, schur, pruned, floor, acc, acc_key, d, M: tl.constexpr):
    """Pair costs of a ``[BLOCK_K, BLOCK_Q]`` tile of ``Z`` folded into the running ``(cost, key)`` minimum."""
    pivot, cost = pair_cost(z, h[:, None], ratio[:, None], remove[:, None], schur[None, :], resid[None, :])
    ok = ok & (pivot > floor[None, :])
    if M > 0:
        ok = ok & ((kept // M)[:, None] == (pruned // M)[None, :])
    cost = tl.where(ok, cost, float("inf"))
    key = kept[:, None] * d + pruned[None, :]
    better = (cost < acc) | ((cost == acc) & (key < acc_key))
    return tl.where(better, cost, acc), tl.where(better, key, acc_key)


@triton.jit
def _scan_kernel(
    z_ptr,
    rows_ptr,
    ratio_ptr,
    h_ptr,
    remove_ptr,
    kept_ptr,
    kept_ok_ptr,
    resid_ptr,
    schur_ptr,
    pruned_ptr,
    pruned_ok_ptr,
    floor_ptr,
    need_ptr,
    k_lo_ptr,
    k_hi_ptr,
    out_val_ptr,
    out_key_ptr,
    fa_ptr,
    fb_ptr,
    rank_ptr,
    K,
    Q,
    d,
    F,
    tiles_per_split,
    n_split,
    n_tiles,
    M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """Row ``i`` of the scan, pruned slots of split ``split``: the smallest cost and its smallest key (``M``: the
    N:M block size, 0 for none). A tile of pruned slots none of which ``need`` marks is neither read nor evaluated;
    with ``M``, only its pairs with kept slots ``[k_lo, k_hi)`` (:func:`kept_slot_ranges`, ``[n, n_tiles]``) are.
    ``z`` is the state's ``Z0^T`` ``[R, Q, K]``; every tile adds the row's ``rank`` pending terms ``fa [R, F, K]``,
    ``fb [R, F, Q]``."""
    i = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    row = tl.load(rows_ptr + i)
    z_row = z_ptr + row * K * Q
    n_terms = tl.load(rank_ptr + row)
    no_key = 9223372036854775807
    # running (cost, key) minimum per tile position, reduced once at the end (no reduction per tile)
    acc = tl.full([BLOCK_K, BLOCK_Q], float("inf"), tl.float64)
    acc_key = tl.full([BLOCK_K, BLOCK_Q], no_key, tl.int64)
    q_begin = split * tiles_per_split * BLOCK_Q
    q_end = tl.minimum(Q, q_begin + tiles_per_split * BLOCK_Q)
    for q0 in range(q_begin, q_end, BLOCK_Q):
        q_idx = q0 + tl.arange(0, BLOCK_Q)
        q_in = q_idx < q_end
        need = tl.max(tl.load(need_ptr + i * Q + q_idx, mask=q_in, other=0).to(tl.int32), axis=0) != 0
        if need:
            resid = tl.load(resid_ptr + i * Q + q_idx, mask=q_in, other=0.0)
            schur = tl.load(schur_ptr + i * Q + q_idx, mask=q_in, other=1.0)
            pruned = tl.load(pruned_ptr + i * Q + q_idx, mask=q_in, other=0)
            floor = tl.load(floor_ptr + i * Q + q_idx, mask=q_in, other=0.0)
            q_ok = q_in & (tl.load(pruned_ok_ptr + i * Q + q_idx, mask=q_in, other=0) != 0)
            k_lo = 0
            k_hi = K
            if M > 0:  # N:M: only the kept slots of the tile's blocks can pair with its pruned slots
                k_lo = tl.load(k_lo_ptr + i * n_tiles + q0 // BLOCK_Q)
                k_hi = tl.load(k_hi_ptr + i * n_tiles + q0 // BLOCK_Q)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                k_idx = k0 + tl.arange(0, BLOCK_K)
                k_in = k_idx < K
                ratio = tl.load(ratio_ptr + i * K + k_idx, mask=k_in, other=0.0)
                h = tl.load(h_ptr + i * K + k_idx, mask=k_in, other=1.0)
                remove = tl.load(remove_ptr + i * K + k_idx, mask=k_in, other=0.0)
                kept = tl.load(kept_ptr + i * K + k_idx, mask=k_in, other=0)
                k_ok = k_in & (tl.load(kept_ok_ptr + i * K + k_idx, mask=k_in, other=0) != 0)
                ok = k_ok[:, None] & q_ok[None, :]
                z = tl.load(z_row + q_idx[None, :].to(tl.int64) * K + k_idx[:, None], mask=ok, other=0.0)
                for t in range(n_terms):  # Z = Z0 + sum_t fa_t fb_t^T
                    term = (row * F + t) * K
                    a = tl.load(fa_ptr + term + k_idx, mask=k_in, other=0.0)
                    b = tl.load(fb_ptr + (row * F + t) * Q + q_idx, mask=q_in, other=0.0)
                    z = z + a[:, None] * b[None, :]
                acc, acc_key = _fold_costs(
                    z, ok, ratio, h, remove, kept, resid, schur, pruned, floor, acc, acc_key, d, M
                )
    best = tl.min(tl.min(acc, axis=1), axis=0)
    best_key = tl.min(tl.min(tl.where(acc == best, acc_key, no_key), axis=1), axis=0)
    tl.store(out_val_ptr + i * n_split + split, best)
    tl.store(out_key_ptr + i * n_split + split, best_key)


def _check_contiguous(t: torch.Tensor, name: str) -> None:
    """The scan addresses ``Z0^T`` as contiguous ``[R, Q, K]`` float64."""
    if t.dtype != torch.float64 or not t.is_contiguous():
        raise ValueError(f"{name} needs a contiguous float64 state tensor, got {t.dtype} with strides {t.stride()}")


def scan_swaps(
    state: TritonRefitState, rows: torch.Tensor, *, q_splits: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best swap of every row in ``rows`` of ``state`` (not modified): the contract, costs and tie rule of
    :func:`refit_state.scan_swaps` (the pair costs of ``Z = Z0 + sum_k fa_k fb_k^T``, each tile read adding the row's
    pending terms; the terms and the slots to evaluate from :func:`scan_terms`).

    Args:
        state: the lazy state; rows: ``[n]`` int64 rows to scan.
        q_splits: programs a row's pruned slots are split across (default: enough to fill the GPU).

    Returns:
        ``dF`` ``[n]`` float64 (``+inf`` where no feasible pair), kept slot ``i`` and pruned slot ``j`` ``[n]``
        int64 (0 and 0 where no pair). Extra memory: ``[n, K]`` and ``[n, Q]`` terms only.
    """
    n = rows.numel()
    (k_slots, q_slots), d = state.slots, state.w64.shape[1]
    dev = state.w64.device
    if n == 0 or k_slots == 0 or q_slots == 0:
        return no_swaps(n, dev)
    _check_contiguous(state.zt, "scan_swaps")
    terms = scan_terms(state, rows, THRESHOLD_COLUMNS, SCAN_TILE[1])  # with N:M also the kept slots' ranges
    if not state.m:  # the N:M ranges are never read: rows stand in
        terms += [rows, rows]
    block_k, block_q, num_warps = SCAN_TILE
    n_tiles = triton.cdiv(q_slots, block_q)
    terms = [t.contiguous() for t in terms]
    n_split, tiles_per_split = tile_splits(n, n_tiles, dev, q_splits, programs_per_sm=SCAN_PROGRAMS_PER_SM)
    part_val = torch.empty(n, n_split, dtype=torch.float64, device=dev)
    part_key = torch.empty(n, n_split, dtype=torch.long, device=dev)
    _scan_kernel[(n, n_split)](
        state.zt, rows.contiguous(), *terms, part_val, part_key, state.fa, state.fb, state.rank, k_slots, q_slots, d,
        state.factor_slots, tiles_per_split, n_split, n_tiles, M=state.m or 0, BLOCK_K=block_k, BLOCK_Q=block_q,
        num_warps=num_warps, enable_fp_fusion=False,
    )  # fmt: skip
    return best_slots(part_val, part_key, terms[3], terms[4], terms[7], terms[8], d)


def best_slots(
    part_val: torch.Tensor,
    part_key: torch.Tensor,
    kept: torch.Tensor,
    kept_ok: torch.Tensor,
    pruned: torch.Tensor,
    pruned_ok: torch.Tensor,
    d: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The scan's answer from its partial minima, in one launch: per row the smallest of ``part_val``, on ties the
    smallest of its ``part_key`` ``u * d + p``, and the first slot holding ``u`` among the occupied kept slots and
    ``p`` among the marked pruned ones.

    Args:
        part_val, part_key: ``[n, n_split]`` float64 and int64 partial minima and keys of the scan's programs.
        kept: ``[n, K]`` int64 kept inputs; kept_ok: ``[n, K]`` int8 occupied (nonzero); pruned: ``[n, Q]`` int64;
            pruned_ok: ``[n, Q]`` int8 the pruned slots that may hold the winner. All contiguous, none modified.
        d: inputs per row.

    Returns:
        ``dF`` ``[n]`` float64 and the kept and pruned slots ``[n]`` int64 (0 and 0 where ``dF`` is ``+inf`` or
        no marked slot holds the input).
    """
    (n, n_split), k_slots, q_slots = part_val.shape, kept.shape[1], pruned.shape[1]
    best = torch.empty(n, dtype=torch.float64, device=part_val.device)
    slot_i, slot_j = (torch.empty(n, dtype=torch.long, device=part_val.device) for _ in range(2))
    _best_slots_kernel[(n,)](
        part_val, part_key, kept, kept_ok, pruned, pruned_ok, best, slot_i, slot_j, k_slots, q_slots, d, n_split,
        BLOCK_S=triton.next_power_of_2(n_split), BLOCK=BEST_SLOTS_BLOCK, enable_fp_fusion=False,
    )  # fmt: skip
    return best, slot_i, slot_j


@triton.jit
def _best_slots_kernel(
    part_val_ptr, part_key_ptr, kept_ptr, kept_ok_ptr, pruned_ptr, pruned_ok_ptr, best_ptr, slot_i_ptr, slot_j_ptr,
    K, Q, d, n_split, BLOCK_S: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Row ``i`` of :func:`best_slots` (one program per row)."""
    i = tl.program_id(0).to(tl.int64)
    no_key = 9223372036854775807
    s = tl.arange(0, BLOCK_S)
    val = tl.load(part_val_ptr + i * n_split + s, mask=s < n_split, other=float("inf"))
    key = tl.load(part_key_ptr + i * n_split + s, mask=s < n_split, other=no_key)
    best = tl.min(val, axis=0)
    best_key = tl.min(tl.where(val == best, key, no_key), axis=0)
    found = best < float("inf")
    u = best_key // d
    p = best_key % d
    tl.store(best_ptr + i, best)
    tl.store(slot_i_ptr + i, tl.where(found, _first_slot(kept_ptr + i * K, kept_ok_ptr + i * K, K, u, BLOCK), 0))
    tl.store(slot_j_ptr + i, tl.where(found, _first_slot(pruned_ptr + i * Q, pruned_ok_ptr + i * Q, Q, p, BLOCK), 0))


@triton.jit
def _first_slot(inputs_row, ok_row, n_slots, target, BLOCK: tl.constexpr):
    """The first of ``n_slots`` slots whose ``ok`` is nonzero and whose input is ``target`` (int64; 0 if none)."""
    first = n_slots
    for s0 in range(0, n_slots, BLOCK):
        idx = s0 + tl.arange(0, BLOCK)
        hit = (idx < n_slots) & (tl.load(ok_row + idx, mask=idx < n_slots, other=0) != 0)
        hit = hit & (tl.load(inputs_row + idx, mask=idx < n_slots, other=-1) == target)
        first = tl.minimum(first, tl.min(tl.where(hit, idx, n_slots), axis=0))
    return tl.where(first < n_slots, first, 0).to(tl.int64)


# The torch references of what the prologue kernel (scan_terms) computes: the tests check the kernel against them, and
# benchmarks/refit_scan_skip.py measures the bound's skip with them on the reference state.


def kept_slot_ranges(
    kept: torch.Tensor, kept_ok: torch.Tensor, pruned: torch.Tensor, scanned: torch.Tensor, m: int, block_q: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """N:M: for every row and tile of ``block_q`` pruned slots, the kept slots ``[k_lo, k_hi)`` that hold the kept
    inputs of the blocks of the tile's ``scanned`` slots: the only kept slots their pairs can use.

    The state lists kept inputs ascending (:func:`refit_state.build_state`) and an N:M swap exchanges two inputs of
    one block, so a row's kept slots stay sorted by block and the range is contiguous. A row whose slots are not
    sorted by block gets every kept slot, ``[0, K)``. An empty range (``k_lo >= k_hi``) where no slot is scanned.

    Args:
        kept: ``[n, K]`` int64 kept inputs; kept_ok: ``[n, K]`` bool occupied; pruned: ``[n, Q]`` int64 pruned
            inputs; scanned: ``[n, Q]`` bool slots to evaluate (none modified). m: the N:M block size.
        block_q: pruned slots per tile.

    Returns:
        ``k_lo``, ``k_hi``: ``[n, ceil(Q / block_q)]`` int64. Cost: ``O(n (K + Q))``.
    """
    n, k_slots = kept.shape
    big = torch.iinfo(torch.int32).max  # above every block; exact as pad's float fill value (int64's max is not)
    kept_block = torch.where(kept_ok, kept // m, big)  # vacant slots last
    pad = -pruned.shape[1] % block_q
    pruned_block = pruned // m

    def per_tile(fill: int) -> torch.Tensor:  # [n, Q] -> [n, tiles, block_q], unscanned slots and padding as fill
        blocks = torch.nn.functional.pad(torch.where(scanned, pruned_block, fill), (0, pad), value=fill)
        return blocks.view(n, -1, block_q)

    k_lo = torch.searchsorted(kept_block, per_tile(big).amin(dim=2))
    k_hi = torch.searchsorted(kept_block, per_tile(-1).amax(dim=2), right=True)
    unsorted = (kept_block[:, 1:] < kept_block[:, :-1]).any(dim=1, keepdim=True)
    return k_lo.masked_fill_(unsorted, 0), k_hi.masked_fill_(unsorted, k_slots)


def columns_to_scan(
    state: RefitState | LazyRefitState,
    rows: torch.Tensor,
    terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pruned_ok: torch.Tensor,
    pivot_floor: torch.Tensor,
    m: int | None,
) -> torch.Tensor:
    """``[n, Q]`` bool: the pruned slots whose pairs the scan of ``rows`` must evaluate; the others cannot win or tie.

    Every pair's change satisfies ``dF(u, p) >= -r_p^2 / s_p`` (the numba engine's bound). The costs of the row's
    ``THRESHOLD_COLUMNS`` columns of largest restore gain give a cost ``c`` the scan reaches; a slot whose bound
    exceeds ``c`` by the rounding margin :data:`refit_state.SKIP_RTOL` is not needed. Rows with a non-positive
    ``H_uu`` or a NaN ``c`` (a broken state) need every slot. ``terms``:
    :func:`refit_state.removal_terms` of ``rows``; ``pruned_ok``: the restorable slots (``Z`` is not modified).
    Cost: ``THRESHOLD_COLUMNS`` ``[n, K]`` columns.
    """
    h_safe, ratio, remove = terms
    kept_ok, schur, resid, pruned = state.kept_ok[rows], state.schur[rows], state.resid[rows], state.pruned[rows]
    positive = pruned_ok & (schur > 0)
    neg_gain = torch.where(positive, -resid.square() / torch.where(positive, schur, 1.0), float("inf"))
    neg_gain = torch.where(pruned_ok & ~positive, -float("inf"), neg_gain)  # no bound there: always scanned
    top = neg_gain.topk(min(THRESHOLD_COLUMNS, neg_gain.shape[1]), dim=1, largest=False).indices  # [n, c]
    column = state.z_columns(rows, top)  # [n, K, c]

    def at_top(t: torch.Tensor) -> torch.Tensor:  # [n, Q] -> [n, 1, c]
        return t.gather(1, top)[:, None, :]

    kept_terms = [t[:, :, None] for t in (h_safe, ratio, remove, state.kept[rows], kept_ok)]
    pruned_terms = [at_top(t) for t in (schur, resid, pruned, pruned_ok)]
    cost = pair_costs(column, *kept_terms, *pruned_terms, pivot_floor, m)
    reached = cost.flatten(1).amin(dim=1, keepdim=True)
    rem_max = torch.where(kept_ok, remove.abs(), 0.0).amax(dim=1, keepdim=True)
    need = ~(neg_gain > reached + SKIP_RTOL * (rem_max - neg_gain))  # NaN: scanned
    need |= ~((h_safe > 0) | ~kept_ok).all(dim=1, keepdim=True)
    return need & pruned_ok


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


def moves(state: TritonRefitState, mode: int, rows: torch.Tensor, slot_a: torch.Tensor, slot_b: torch.Tensor):
    """Apply move ``mode`` (:data:`SWAP`, :data:`REMOVE`, :data:`ADD`) to each of the distinct ``rows`` of ``state``
    (``[n]`` int64; ``slot_a`` kept slots, ``slot_b`` pruned slots as in :class:`TritonRefitState`), in place.
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
    """Program ``e``: the scan's terms of row ``rows[e]`` (``refit_state.removal_terms``, ``restorable``, the pivot
    floor of each pruned slot) into ``[n, K]`` and ``[n, Q]`` outputs, and ``need``: :func:`columns_to_scan` with the
    costs of the row's ``C`` columns of largest restore gain (``gain``: ``[n, Q]`` scratch). With N:M (``M > 0``)
    also ``k_lo``, ``k_hi`` (``[n, n_tiles]``): :func:`kept_slot_ranges` for tiles of ``TILE_Q`` pruned slots, by
    binary searches of ``steps`` halvings over the row's kept blocks (``TILE_BLOCK``: a multiple of ``TILE_Q``)."""
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
    """``[1]`` float64 :data:`refit_state.SKIP_RTOL` on ``device`` (a float64 kernel argument; a Python float would
    pass as float32), copied there once instead of once per scan."""
    return torch.tensor([SKIP_RTOL], dtype=torch.float64, device=device)


def scan_terms(state: TritonRefitState, rows: torch.Tensor, threshold_columns: int, tile_q: int) -> list[torch.Tensor]:
    """The terms :func:`scan_swaps` passes its kernel for rows ``rows`` of ``state``, in its order -- ``ratio``,
    ``h_safe``, ``remove``, ``kept``, ``kept_ok`` (int8), ``resid``, ``schur``, ``pruned``, restorable (int8), the
    pivot floor of each pruned slot, ``need`` (int8), and with N:M ``k_lo``, ``k_hi`` (:func:`kept_slot_ranges` for
    tiles of ``tile_q`` pruned slots) -- from one kernel launch: the torch references' gathers,
    :func:`columns_to_scan` (``threshold_columns`` columns set the threshold) and :func:`kept_slot_ranges`, bit for
    bit."""
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


class TritonRefitState(LazyRefitState):
    """The lazy re-fit state (:class:`~sparseswaps_prune.core.backends.refit_lazy.LazyRefitState`: attributes,
    arguments, build, fold, grow) on CUDA tensors (CPU ones in the Triton interpreter), its scan
    :func:`scan_swaps` and its moves :func:`moves`; every row folds its pending terms when a call could overflow one.
    Slot counts are rounded up by :func:`aligned_slots` (:meth:`slot_count`).

    Raises:
        ValueError: a bad ``factor_slots``, or a singular ``G_SS + lambda I`` (names the rows).
    """

    @staticmethod
    def slot_count(n_slots: int, d: int) -> int:
        """:func:`aligned_slots`."""
        return aligned_slots(n_slots, d)

    def scan(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:func:`scan_swaps` of ``rows``."""
        return scan_swaps(self, rows)

    def _make_room(self, terms: int) -> None:
        """Fold every row before a call that adds ``terms`` pending terms per row could overflow one."""
        if self.max_rank + terms > self.factor_slots:
            self.fold(torch.arange(self.rank.numel(), device=self.rank.device))
            self.max_rank = 0
        self.max_rank += terms

    def swap(self, rows: torch.Tensor, slot_i: torch.Tensor, slot_j: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Swap kept slot ``slot_i`` and pruned slot ``slot_j`` of each (distinct) row; returns the inputs
        ``(u, p)``."""
        self._make_room(2)
        return moves(self, SWAP, rows, slot_i, slot_j)

    def remove(self, rows: torch.Tensor, slot_i: torch.Tensor, vacant_j: torch.Tensor) -> torch.Tensor:
        """Prune kept slot ``slot_i`` of each row into its vacant pruned slot ``vacant_j``; returns the inputs."""
        self._make_room(1)
        return moves(self, REMOVE, rows, slot_i, vacant_j)[0]

    def add(self, rows: torch.Tensor, slot_j: torch.Tensor, vacant_i: torch.Tensor) -> torch.Tensor:
        """Restore pruned slot ``slot_j`` of each row into its vacant kept slot ``vacant_i`` (the pruned slot
        becomes vacant); returns the inputs."""
        self._make_room(1)
        return moves(self, ADD, rows, vacant_i, slot_j)[1]
