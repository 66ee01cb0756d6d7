"""The re-fit objective's CUDA engine: the torch state of :mod:`~sparseswaps_prune.core.refit_swaps` with its
``[R, K, Q]`` and ``[R, K, K]`` passes fused into Triton kernels (CPU only through the Triton interpreter,
``TRITON_INTERPRET=1``, for testing).

The torch reference spends an iteration in elementwise passes over the state ``Z`` (``[R, K, Q]`` float64, 51 MiB
per row at ``d_in = 4096``): the pair scan builds ten ``[n, K, Q]`` temporaries, and each rank-one update of ``Z``
and ``H`` materialises its outer product before adding it. Here

* :func:`scan_swaps` reads ``Z`` at most once: one program owns a row and a range of pruned slots, evaluates the
  pair costs ``v_u^2 / H_uu - (r_p + Z_up v_u / H_uu)^2 / (s_p + Z_up^2 / H_uu)`` tile by tile in registers with
  the reference's operations in the reference's order, compiled without fused multiply-add
  (``enable_fp_fusion=False``), so the costs are bit-identical to :func:`refit_swaps.scan_swaps`; it keeps the
  minimum and, on ties, the smallest input-index key ``u * d + p``, the reference's tie rule; it neither reads nor
  evaluates the tiles of pruned slots that cannot win or tie by the numba engine's bound
  ``dF(u, p) >= -r_p^2 / s_p`` against the costs of the row's columns of largest restore gain
  (:func:`columns_to_scan`); with N:M a tile of pruned slots evaluates only the kept slots of its blocks
  (:func:`kept_slot_ranges`);
* :func:`add_outer` adds ``a b^T`` to the rows' ``Z`` or ``H`` in one read and write (``t + a * b``, again without
  fused multiply-add, so bit-identical to the reference's ``index_add_`` of the materialised product);
* :func:`swap_slots` applies a swap (the removal's and the restore's rank-one updates) with one read and write of
  ``H``'s upper triangle (``H`` is symmetric and read only there) and one of ``Z`` (the state bit-identical to the
  reference's :func:`refit_swaps.swap_slots` where it is read, :meth:`RefitState.same_as`); the scan of the swapped
  rows that follows reads again only the tiles the bound leaves.

The state build and a restore's vector ``G[p, S] Z`` (a product with the shared Gram) stay in torch. Cross-row moves
(layer scope): :func:`refit_swaps.remove_kept` etc. with ``outer=add_outer``; the engines choose the same swaps.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparseswaps_prune.core.backends.refit_lazy import LazyRefitState
from sparseswaps_prune.core.backends.triton_search import tile_splits
from sparseswaps_prune.core.refit_swaps import (
    SKIP_RTOL,
    RefitState,
    add_pruned,
    no_swaps,
    pair_costs,
    removal_terms,
    remove_kept,
    restorable,
)

# (BLOCK_K, BLOCK_Q, num_warps) of the scan and (BLOCK_A, BLOCK_B, num_warps) of the rank-one update, on an H200
# (BENCHMARKS.md, "Tile shapes of the pair scan" and "Fused or split"; `benchmarks/refit_scan_tiles.py`): the scan
# is fastest with small tiles (16 x 32: 1.3 TB/s of Z against 0.8 TB/s at 4 x 256, before the bound skip); the
# update streams Z and H. A scan fused into the update's pass was no faster than the update and the scan after it
# (by ptxas's count the fused pass needs 182 registers per thread at 8 x 512 x 8 against the update's 92: one block
# per SM instead of two), so the iteration runs them one after the other.
SCAN_TILE = (16, 32, 4)
OUTER_TILE = (8, 512, 8)
# Scan programs aimed for per streaming multiprocessor (a row's pruned slots are split to reach it; 4 to 32 made no
# consistent difference in the sweep).
SCAN_PROGRAMS_PER_SM = 4
# Columns of largest restore gain whose pair costs set a row's skip threshold (columns_to_scan): more than one, so
# that an N:M row's threshold comes from a pair its block allows (the N:M test layer asks for at most 12 of about
# 150 pruned slots per row to be evaluated).
THRESHOLD_COLUMNS = 4
# The Triton engine's slot counts K and Q are rounded up to a multiple of this (vacant slots, at most d_in each):
# Triton specializes integer arguments divisible by 16, so with the row strides of H (K) and Z (Q) multiples of 16
# it can prove every row 16-byte aligned and emits 16-byte loads and stores (PTX ld/st.global.v2.b64) in the passes
# over H and Z instead of 8-byte ones (checked in the sm_90 PTX; A/B on a GPU: refit_swaps.py --slot-align 1).
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
    pruned-slot (``schur``, ``resid``) terms, broadcast: :func:`refit_swaps.pair_costs`'s operations in its order
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
    LAZY: tl.constexpr,
):
    """Row ``i`` of the scan, pruned slots of split ``split``: the smallest cost and its smallest key (``M``: the
    N:M block size, 0 for none). A tile of pruned slots none of which ``need`` marks is neither read nor evaluated;
    with ``M``, only its pairs with kept slots ``[k_lo, k_hi)`` (:func:`kept_slot_ranges`, ``[n, n_tiles]``) are.
    ``LAZY``: ``z`` is a lazy state's ``Z0^T`` ``[R, Q, K]`` and every tile adds the row's ``rank`` pending terms
    ``fa [R, F, K]``, ``fb [R, F, Q]``; otherwise ``z`` is ``Z`` ``[R, K, Q]`` (``fa``, ``fb``, ``rank``, ``F``
    unused)."""
    i = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    row = tl.load(rows_ptr + i)
    z_row = z_ptr + row * K * Q
    n_terms = 0
    if LAZY:
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
                if LAZY:
                    z = tl.load(z_row + q_idx[None, :].to(tl.int64) * K + k_idx[:, None], mask=ok, other=0.0)
                    for t in range(n_terms):  # Z = Z0 + sum_t fa_t fb_t^T
                        term = (row * F + t) * K
                        a = tl.load(fa_ptr + term + k_idx, mask=k_in, other=0.0)
                        b = tl.load(fb_ptr + (row * F + t) * Q + q_idx, mask=q_in, other=0.0)
                        z = z + a[:, None] * b[None, :]
                else:
                    z = tl.load(z_row + k_idx[:, None].to(tl.int64) * Q + q_idx[None, :], mask=ok, other=0.0)
                acc, acc_key = _fold_costs(
                    z, ok, ratio, h, remove, kept, resid, schur, pruned, floor, acc, acc_key, d, M
                )
    best = tl.min(tl.min(acc, axis=1), axis=0)
    best_key = tl.min(tl.min(tl.where(acc == best, acc_key, no_key), axis=1), axis=0)
    tl.store(out_val_ptr + i * n_split + split, best)
    tl.store(out_key_ptr + i * n_split + split, best_key)


@triton.jit
def _pair_update(
    t_ptr, rows_ptr, first_a_ptr, first_b_ptr, second_a_ptr, second_b_ptr, skip_a_ptr, skip_b_ptr, A, B,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, PAIR: tl.constexpr, UPPER: tl.constexpr,
):  # fmt: skip
    """``t[rows[i]] += first_a[i] first_b[i]^T`` on one tile; with ``PAIR``, instead
    ``t = (t + first_a first_b^T, except on row skip_a[i] and column skip_b[i]) + second_a second_b^T``: a swap's
    removal and restore updates in one read and write (its row and column there were written before). With
    ``UPPER`` only the entries on and above the diagonal of a symmetric ``t`` (``H``), and the one left of the
    diagonal where it shares a 16-byte pair with it."""
    if UPPER:
        if (tl.program_id(2) + 1) * BLOCK_B <= tl.program_id(1) * BLOCK_A:
            return  # the tile lies below the diagonal
    i = tl.program_id(0).to(tl.int64)
    a_idx = tl.program_id(1) * BLOCK_A + tl.arange(0, BLOCK_A)
    b_idx = tl.program_id(2) * BLOCK_B + tl.arange(0, BLOCK_B)
    a_in, b_in = a_idx < A, b_idx < B
    a = tl.load(first_a_ptr + i * A + a_idx, mask=a_in, other=0.0)
    b = tl.load(first_b_ptr + i * B + b_idx, mask=b_in, other=0.0)
    ptrs = t_ptr + tl.load(rows_ptr + i) * A * B + a_idx[:, None].to(tl.int64) * B + b_idx[None, :]
    ok = a_in[:, None] & b_in[None, :]
    if UPPER:  # by pairs of columns, so that the mask stays uniform over a 16-byte load (PTX ld.global.v2.b64)
        ok = ok & ((b_idx // 2 * 2 + 1)[None, :] >= a_idx[:, None])
    t = tl.load(ptrs, mask=ok, other=0.0)
    if PAIR:
        first = (a_idx != tl.load(skip_a_ptr + i))[:, None] & (b_idx != tl.load(skip_b_ptr + i))[None, :]
        t = tl.where(first, t + a[:, None] * b[None, :], t)
        second_a = tl.load(second_a_ptr + i * A + a_idx, mask=a_in, other=0.0)
        second_b = tl.load(second_b_ptr + i * B + b_idx, mask=b_in, other=0.0)
        t = t + second_a[:, None] * second_b[None, :]
    else:
        t = t + a[:, None] * b[None, :]
    tl.store(ptrs, t, mask=ok)


def _check_contiguous(t: torch.Tensor, name: str) -> None:
    """The kernels address a state tensor as contiguous ``[R, A, B]`` float64."""
    if t.dtype != torch.float64 or not t.is_contiguous():
        raise ValueError(f"{name} needs a contiguous float64 state tensor, got {t.dtype} with strides {t.stride()}")


def scan_swaps(
    state: RefitState | LazyRefitState,
    w64: torch.Tensor,
    rows: torch.Tensor,
    pivot_floor: torch.Tensor,
    m: int | None = None,
    *,
    q_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best swap of every row in ``rows``: the contract, costs and tie rule of :func:`refit_swaps.scan_swaps`.

    Args:
        state: the batch state (not modified; its ``z`` must be contiguous), or a
            :class:`~sparseswaps_prune.core.backends.refit_lazy.LazyRefitState` (each tile read adds the row's
            pending terms); w64: ``[R, d]`` float64 weights.
        rows: ``[n]`` int64 rows of the batch to scan.
        pivot_floor: ``[d]`` smallest admissible new pivot per input; m: N:M block size, or None.
        q_splits: programs a row's pruned slots are split across (default: enough to fill the GPU).

    Returns:
        ``dF`` ``[n]`` float64 (``+inf`` where no feasible pair), kept slot ``i`` and pruned slot ``j`` ``[n]``
        int64 (0 and 0 where no pair). Extra memory: ``[n, K]`` and ``[n, Q]`` terms only.
    """
    n = rows.numel()
    k_slots, q_slots = state.kept.shape[1], state.pruned.shape[1]
    d = w64.shape[1]
    dev = w64.device
    if n == 0 or k_slots == 0 or q_slots == 0:
        return no_swaps(n, dev)
    lazy = isinstance(state, LazyRefitState)
    z = state.zt if lazy else state.z
    _check_contiguous(z, "scan_swaps")
    # a lazy state's pending terms (unused otherwise: z stands in)
    pending = (state.fa, state.fb, state.rank, state.factor_slots) if lazy else (z, z, rows, 0)
    fused = lazy and state.fused
    if fused:  # the terms from one kernel (the state's own pivot floor)
        from sparseswaps_prune.core.backends.refit_lazy_triton import scan_terms

        terms = scan_terms(state, rows, THRESHOLD_COLUMNS, SCAN_TILE[1])  # with N:M also the kept slots' ranges
    else:
        kept, kept_ok, pruned = state.kept[rows], state.kept_ok[rows].to(torch.int8), state.pruned[rows]
        h_safe, ratio, remove = removal_terms(state, rows)  # as the reference
        pruned_ok = restorable(state, w64, rows)
        need = columns_to_scan(state, rows, (h_safe, ratio, remove), pruned_ok, pivot_floor, m)
        terms = [ratio, h_safe, remove, kept, kept_ok, state.resid[rows], state.schur[rows], pruned,
                 pruned_ok.to(torch.int8), pivot_floor[pruned], need.to(torch.int8)]  # fmt: skip
    block_k, block_q, num_warps = SCAN_TILE
    n_tiles = triton.cdiv(q_slots, block_q)
    # N:M: the kept slots each tile of pruned slots can pair with (without N:M never read: rows stands in)
    if not m:
        terms += [rows, rows]
    elif not fused:  # (the fused terms hold them)
        terms += kept_slot_ranges(kept, kept_ok != 0, pruned, need, m, block_q)
    terms = [t.contiguous() for t in terms]
    n_split, tiles_per_split = tile_splits(n, n_tiles, dev, q_splits, programs_per_sm=SCAN_PROGRAMS_PER_SM)
    part_val = torch.empty(n, n_split, dtype=torch.float64, device=dev)
    part_key = torch.empty(n, n_split, dtype=torch.long, device=dev)
    _scan_kernel[(n, n_split)](
        z, rows.contiguous(), *terms, part_val, part_key, *pending[:3], k_slots, q_slots, d, pending[3],
        tiles_per_split, n_split, n_tiles, M=m or 0, BLOCK_K=block_k, BLOCK_Q=block_q, LAZY=lazy,
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


def kept_slot_ranges(
    kept: torch.Tensor, kept_ok: torch.Tensor, pruned: torch.Tensor, scanned: torch.Tensor, m: int, block_q: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """N:M: for every row and tile of ``block_q`` pruned slots, the kept slots ``[k_lo, k_hi)`` that hold the kept
    inputs of the blocks of the tile's ``scanned`` slots: the only kept slots their pairs can use.

    The state lists kept inputs ascending (:func:`refit_swaps.build_state`) and an N:M swap exchanges two inputs of
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
    state: RefitState,
    rows: torch.Tensor,
    terms: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pruned_ok: torch.Tensor,
    pivot_floor: torch.Tensor,
    m: int | None,
) -> torch.Tensor:
    """``[n, Q]`` bool: the pruned slots whose pairs the scan of ``rows`` must evaluate; the others cannot win or tie.

    Every pair's change satisfies ``dF(u, p) >= -r_p^2 / s_p`` (the numba engine's bound). The costs of the row's
    ``THRESHOLD_COLUMNS`` columns of largest restore gain give a cost ``c`` the scan reaches; a slot whose bound
    exceeds ``c`` by the rounding margin :data:`refit_swaps.SKIP_RTOL` is not needed. Rows with a non-positive
    ``H_uu`` or a NaN ``c`` (a broken state) need every slot. ``terms``:
    :func:`refit_swaps.removal_terms` of ``rows``; ``pruned_ok``: the restorable slots (``Z`` is not modified).
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


def _launch_update(
    target: torch.Tensor, rows: torch.Tensor, first: tuple, second: tuple | None = None, upper: bool = False
) -> None:
    """:func:`_pair_update` over the rows' ``[A, B]`` entries of ``target``: ``first = (a, b)``; ``second = (a, b,
    skip_a, skip_b)`` for a swap's pair of updates; ``upper``: only the entries on and above the diagonal."""
    n, (_, size_a, size_b) = rows.numel(), target.shape
    _check_contiguous(target, "add_outer")
    if n == 0 or size_a == 0 or size_b == 0:
        return
    block_a, block_b, num_warps = OUTER_TILE
    grid = (n, triton.cdiv(size_a, block_a), triton.cdiv(size_b, block_b))
    rest = [t.contiguous() for t in second] if second is not None else [first[0], first[1], rows, rows]
    _pair_update[grid](
        target, rows.contiguous(), first[0].contiguous(), first[1].contiguous(), *rest, size_a, size_b,
        BLOCK_A=block_a, BLOCK_B=block_b, PAIR=second is not None, UPPER=upper, num_warps=num_warps,
        enable_fp_fusion=False,
    )  # fmt: skip


def add_outer(target: torch.Tensor, rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``target[rows[n]] += a[n, :, None] * b[n, None, :]`` in place, one read and write of the rows' entries.

    ``target``: contiguous ``[R, A, B]`` float64; ``rows``: ``[n]`` int64, distinct; ``a`` ``[n, A]``, ``b``
    ``[n, B]`` float64. Bit-identical to adding the materialised product.
    """
    _launch_update(target, rows, (a, b))


def swap_slots(
    state: RefitState, rows: torch.Tensor, slot_i: torch.Tensor, slot_j: torch.Tensor, gram64: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`refit_swaps.swap_slots` (the same state, bit for bit where it is read: :meth:`RefitState.same_as`) with
    ``H``'s upper triangle and ``Z`` each read and written once.

    The swap's vector updates run as the reference's (:func:`refit_swaps.remove_kept`, :func:`refit_swaps.add_pruned`)
    with their four rank-one updates deferred; then one pass applies the removal's and the restore's update of
    ``H`` on and above its diagonal (the entries below stay stale: half of ``H``'s traffic) and one pass those of
    ``Z``. ``rows``: ``[n]`` int64 distinct rows; ``slot_i``, ``slot_j``: ``[n]`` kept and
    pruned slots; ``gram64``: ``[d, d]`` float64. ``state`` is modified in place. (A scan of the swapped rows fused
    into the pass over ``Z`` was timed: no faster on an H200, BENCHMARKS.md "Fused or split"; the caller scans
    them with :func:`scan_swaps`.)

    Returns:
        ``(u, p)`` ``[n]`` the pruned and the restored inputs.
    """
    _check_contiguous(state.inv, "swap_slots")
    _check_contiguous(state.z, "swap_slots")
    rows, slot_i, slot_j = (t.to(state.z.device) for t in (rows, slot_i, slot_j))
    ar = torch.arange(rows.numel(), device=rows.device)
    deferred: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {id(state.inv): [], id(state.z): []}

    def defer(target: torch.Tensor, _rows: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        deferred[id(target)].append((a.clone(), b.clone()))

    column = state.z[rows, :, slot_j]  # Z[:, p] before the removal
    p = state.pruned[rows, slot_j]
    incoming = remove_kept(state, rows, slot_i, defer)
    removal_a, removal_b = deferred[id(state.z)][0]
    column = column + removal_a * removal_b[ar, slot_j][:, None]  # the removal's update of Z[:, p], as it rounds
    column[ar, slot_i] = 0.0  # the removed row of Z
    add_pruned(state, rows, slot_j, slot_i, gram64, incoming, defer, column=column)
    (h_a, h_b), (h_a2, h_b2) = deferred[id(state.inv)]
    _launch_update(state.inv, rows, (h_a, h_b), (h_a2, h_b2, slot_i, slot_i), upper=True)
    (z_a, z_b), (z_a2, z_b2) = deferred[id(state.z)]
    _launch_update(state.z, rows, (z_a, z_b), (z_a2, z_b2, slot_i, slot_j))
    return incoming[0], p
