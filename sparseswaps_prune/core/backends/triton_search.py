"""Fused best-swap search in Triton (CUDA; CPU only through the Triton interpreter, ``TRITON_INTERPRET=1``).

One program owns a block of ``BLOCK_R`` rows and a contiguous range of ``u`` tiles. For each
``(u, p)`` tile it loads ``G[u0:u0+BLOCK_U, p0:p0+BLOCK_P]`` once and evaluates the pair costs of all
its rows against it in registers (``[BLOCK_R, BLOCK_U, BLOCK_P]``), never materialising the
``[rows, d, d]`` cost tensor: ``G`` is the only ``d x d`` operand and is shared by every row. The
cost is evaluated with the torch backend's operations in the torch backend's order,
``restore[p] + cross[u] * (G[u, p] * restore_weight[p])``, and the kernel is compiled without
fused multiply-add (``enable_fp_fusion=False``), so the minima are bit-identical to ``best_swaps_torch``.
Per row it keeps the running minimum over ``p`` of every ``u`` of the current ``u`` tile, then the
smallest ``u`` reaching the tile's best ``remove[u] + min_p``; a strict ``<`` across ascending tiles
keeps the smallest ``u`` on ties. The ``u`` range is split across programs (a second grid axis) so
that a few row blocks still fill the GPU; the per-split winners are reduced in torch (first index on
ties, i.e. the smallest ``u``). Finally the winning ``p`` of each row is recovered in torch from the
single row ``G[u_best]`` (``argmin``, first index on ties, as the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparseswaps_prune.core.backends.terms import swap_terms

# (BLOCK_R, BLOCK_U, BLOCK_P, num_warps) per dtype: 32 cost values per thread; compiled for sm_90 (ptxas, no GPU
# run) these use 123 (fp32) and 183 (fp64) registers, no spills, no FMA in the SASS. Untuned on real hardware.
TILES = {torch.float32: (16, 16, 32, 8), torch.float64: (16, 16, 32, 8)}
# Programs aimed for per streaming multiprocessor when splitting the u range.
PROGRAMS_PER_SM = 4


@triton.jit
def _best_u_kernel(
    remove_ptr,
    restore_ptr,
    cross_ptr,
    restore_weight_ptr,
    gram_ptr,
    out_val_ptr,
    out_u_ptr,
    rows,
    d,
    tiles_per_split,
    n_split,
    BLOCK_R: tl.constexpr,
    BLOCK_U: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Per row of the block: ``min_u remove[u] + min_p cost[u, p]`` over this program's u range and the
    smallest ``u`` reaching it; written to ``out_val[r, split]``, ``out_u[r, split]``."""
    block = tl.program_id(0)
    split = tl.program_id(1)
    r_idx = block * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r_idx < rows
    r_off = r_idx.to(tl.int64) * d
    dtype = remove_ptr.dtype.element_ty
    inf = float("inf")
    best = tl.full([BLOCK_R], inf, dtype)
    best_u = tl.zeros([BLOCK_R], tl.int64)
    u_begin = split * tiles_per_split * BLOCK_U
    u_end = tl.minimum(d, u_begin + tiles_per_split * BLOCK_U)
    for u0 in range(u_begin, u_end, BLOCK_U):
        u_idx = u0 + tl.arange(0, BLOCK_U)
        u_ok = u_idx < u_end
        ru_off = r_off[:, None] + u_idx[None, :]
        ru_ok = r_ok[:, None] & u_ok[None, :]
        remove = tl.load(remove_ptr + ru_off, mask=ru_ok, other=inf)  # [R, U]
        cross = tl.load(cross_ptr + ru_off, mask=ru_ok, other=0.0)  # [R, U]
        pair_min = tl.full([BLOCK_R, BLOCK_U], inf, dtype)
        g_row = u_idx.to(tl.int64) * d
        for p0 in range(0, d, BLOCK_P):
            p_idx = p0 + tl.arange(0, BLOCK_P)
            p_ok = p_idx < d
            # the G tile: loaded once, used by all BLOCK_R rows
            g = tl.load(gram_ptr + g_row[:, None] + p_idx[None, :], mask=u_ok[:, None] & p_ok[None, :], other=0.0)
            rp_off = r_off[:, None] + p_idx[None, :]
            rp_ok = r_ok[:, None] & p_ok[None, :]
            restore = tl.load(restore_ptr + rp_off, mask=rp_ok, other=inf)  # [R, P]
            restore_weight = tl.load(restore_weight_ptr + rp_off, mask=rp_ok, other=0.0)  # [R, P]
            # same operations and order as best_swaps_torch (no fma: enable_fp_fusion=False at launch)
            cost = restore[:, None, :] + cross[:, :, None] * (g[None, :, :] * restore_weight[:, None, :])
            pair_min = tl.minimum(pair_min, tl.min(cost, axis=2))
        total = remove + pair_min  # [R, U]
        tile_best = tl.min(total, axis=1)
        tile_u = tl.min(tl.where(total == tile_best[:, None], u_idx[None, :], d), axis=1).to(tl.int64)
        better = tile_best < best  # strict: an earlier tile (smaller u) wins ties
        best = tl.where(better, tile_best, best)
        best_u = tl.where(better, tile_u, best_u)
    out_off = r_idx.to(tl.int64) * n_split + split
    tl.store(out_val_ptr + out_off, best, mask=r_ok)
    tl.store(out_u_ptr + out_off, best_u, mask=r_ok)


def tile_splits(
    n_blocks: int, n_tiles: int, device: torch.device, splits: int | None = None, programs_per_sm: int = PROGRAMS_PER_SM
) -> tuple[int, int]:
    """``(splits, tiles per split)`` of a range of ``n_tiles`` tiles shared by ``n_blocks`` blocks of programs:
    ``splits`` if given (at most ``n_tiles``), else enough programs to fill the GPU, ``programs_per_sm`` per
    streaming multiprocessor (one split in the interpreter)."""
    if splits is None:
        splits = 1
        if device.type == "cuda":
            target = programs_per_sm * torch.cuda.get_device_properties(device).multi_processor_count
            splits = -(-target // max(1, n_blocks))
    per_split = triton.cdiv(n_tiles, max(1, min(n_tiles, splits)))
    return triton.cdiv(n_tiles, per_split), per_split


def best_swaps_triton(
    weight: torch.Tensor,
    keep: torch.Tensor,
    corr: torch.Tensor,
    gram: torch.Tensor,
    *,
    u_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Best per-row 1-swap with the fused kernel; same contract and tie rule as ``best_swaps_torch``.

    ``weight``, ``corr`` ``[rows, d]`` and ``gram`` ``[d, d]`` share one dtype (float32 or float64);
    ``keep`` is bool ``[rows, d]``. Returns ``u``, ``p`` int64 ``[rows]`` and ``dL`` ``[rows]``
    (``+inf``, with ``u = p = 0``, where no pair exists). Inputs are not modified. Extra memory:
    the four ``[rows, d]`` swap terms and one ``[rows, d]`` row of costs for the ``p`` recovery.
    ``u_splits`` overrides the number of programs the ``u`` range is split across (default: enough to
    fill the GPU; 1 in the interpreter).
    """
    if weight.dtype not in TILES:
        raise TypeError(f"the triton backend supports float32 and float64, got {weight.dtype}")
    rows, d = weight.shape
    device = weight.device
    gram = gram.to(weight.dtype).contiguous()
    remove, restore, cross, restore_weight = (
        t.contiguous() for t in swap_terms(weight, keep, corr.to(weight.dtype), torch.diagonal(gram))
    )
    if rows == 0 or d == 0:
        empty = torch.zeros(rows, dtype=torch.long, device=device)
        return empty, empty.clone(), torch.full((rows,), float("inf"), dtype=weight.dtype, device=device)
    block_r, block_u, block_p, num_warps = TILES[weight.dtype]
    n_row_blocks = triton.cdiv(rows, block_r)
    n_u_tiles = triton.cdiv(d, block_u)
    n_split, tiles_per_split = tile_splits(n_row_blocks, n_u_tiles, device, u_splits)
    part_val = torch.empty(rows, n_split, dtype=weight.dtype, device=device)
    part_u = torch.empty(rows, n_split, dtype=torch.long, device=device)
    _best_u_kernel[(n_row_blocks, n_split)](
        remove,
        restore,
        cross,
        restore_weight,
        gram,
        part_val,
        part_u,
        rows,
        d,
        tiles_per_split,
        n_split,
        BLOCK_R=block_r,
        BLOCK_U=block_u,
        BLOCK_P=block_p,
        num_warps=num_warps,
        enable_fp_fusion=False,
    )
    best, split = part_val.min(dim=1)  # first (smallest-u) split on ties
    best_u = part_u.gather(1, split[:, None]).squeeze(1)
    found = best < float("inf")
    best_u = torch.where(found, best_u, 0)
    # p recovery: the winning u's pair costs, exactly as the reference evaluates them
    cost = restore + cross.gather(1, best_u[:, None]) * (gram[best_u] * restore_weight)
    best_p = torch.where(found, cost.argmin(dim=1), 0)
    return best_u, best_p, best
