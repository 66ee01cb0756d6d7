"""Launch shapes of the Triton re-fit engine: for each tile ``(BLOCK_K, BLOCK_Q, num_warps)`` of the pair scan
(``refit_triton.SCAN_TILE``) and each count of programs aimed for per streaming multiprocessor
(``refit_triton.SCAN_PROGRAMS_PER_SM``), seconds per row and the bytes of ``Z`` per second (all of ``Z``, though the
scan skips the tiles :func:`refit_triton.columns_to_scan` leaves out, so a rate over the bandwidth is possible); and
for each tile ``(BLOCK_A, BLOCK_B, num_warps)`` of the rank-one update (``refit_triton.OUTER_TILE``), the time of an
iteration (``swap_slots``: the update of ``H`` and ``Z``; then ``scan_swaps``), on ``common.random_layer`` (random
correlated Gram, Wanda mask of ``--pattern``, 60% by default or N:M). Every scan is checked against the torch
reference (``refit_swaps.scan_swaps``): ``same`` says its costs and slots are bit-identical, and every iteration's
state and scan against the reference's :func:`refit_swaps.swap_slots` and scan. CUDA (``--device cpu`` only under
``TRITON_INTERPRET=1``, to check the script at small widths).

    python benchmarks/refit_scan_tiles.py [--widths 4096 14336] [--rows 64 8] [--tiles 16x32x4 ...] [--per-sm 4 16]
                                          [--update-tiles 8x512x8 ...] [--pattern 60%|2:4]
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from common import timed, triton_refit_iteration, triton_refit_layer

from sparseswaps_prune.core import refit_swaps as rs
from sparseswaps_prune.core.backends import refit_triton

SCAN_TILES = ["4x256x4", "2x512x4", "4x128x4", "8x64x4", "16x64x4", "32x64x8", "16x32x4", "8x128x8"]
UPDATE_TILES = ["8x512x8", "4x512x4", "8x512x4", "4x1024x8", "16x256x8", "2x512x2", "8x256x4"]


def _copy(state: rs.RefitState) -> rs.RefitState:
    return rs.RefitState(*(t.clone() for t in dataclasses.astuple(state)))


def swap_iterations(state: rs.RefitState, weight, gram, rows, floor, m: int | None, iters: int) -> tuple[float, bool]:
    """Mean seconds of an iteration of the row scope on a copy of ``state`` (``refit_triton.swap_slots`` of the
    rows whose best swap lowers the loss, then the scan of those rows), after one warm-up iteration; and whether
    that first iteration's state and scan are bit-identical to the reference's (``refit_swaps.swap_slots``, then
    ``refit_swaps.scan_swaps``). ``m``: the N:M block size or None."""
    state = _copy(state)
    figures = refit_triton.scan_swaps(state, weight, rows, floor, m)
    accept = figures[0] < 0
    want = _copy(state)
    rs.swap_slots(want, rows[accept], figures[1][accept], figures[2][accept], gram)
    want_scan = rs.scan_swaps(want, weight, rows[accept], floor, m)
    checked: list[bool] = []

    def iteration() -> None:
        scan = triton_refit_iteration(state, weight, gram, rows, floor, m, figures)
        if not checked:  # the warm-up iteration: against the reference
            same_scan = all(torch.equal(a, b) for a, b in zip(scan, want_scan, strict=True))
            checked.append(state.same_as(want) and same_scan)

    return timed(iteration, iters), checked[0]


def _set_tiles(scan: str, update: str, programs: int) -> None:
    refit_triton.SCAN_TILE = tuple(int(x) for x in scan.split("x"))
    refit_triton.OUTER_TILE = tuple(int(x) for x in update.split("x"))
    refit_triton.SCAN_PROGRAMS_PER_SM = programs


def sweep(
    d_in: int,
    n_rows: int,
    device: str,
    tiles: list[str],
    per_sm: list[int],
    update_tiles: list[str],
    repeat: int,
    pattern: str = "60%",
) -> tuple[int, list, list]:
    """``(bytes of Z, [(scan tile, programs per SM, scan seconds for all rows, same as the reference)], [(update
    tile, iteration seconds for all rows, same as the reference)])`` at one width (the default scan tile and
    programs for the iterations, the default update tile for the scans)."""
    weight, gram, keep, state, floor, m = triton_refit_layer(d_in, n_rows, pattern, device)
    rows = torch.arange(n_rows, device=device)
    reference = rs.scan_swaps(state, weight, rows, floor, m)
    needed = refit_triton.columns_to_scan(
        state, rows, rs.removal_terms(state, rows), rs.restorable(state, weight, rows), floor, m
    )
    mean_needed = float(needed.sum(1).float().mean())
    q = d_in - int(keep.sum(1).min())  # the pruned inputs (the state has vacant slots beyond them)
    print(f"{d_in:>5} {n_rows:>4} slots the scan evaluates (columns_to_scan): {mean_needed:.1f} of {q} per row")

    def scan() -> tuple[torch.Tensor, ...]:
        return refit_triton.scan_swaps(state, weight, rows, floor, m)

    default = (refit_triton.SCAN_TILE, refit_triton.OUTER_TILE, refit_triton.SCAN_PROGRAMS_PER_SM)
    scan_default, update_default = ("x".join(map(str, tile)) for tile in default[:2])
    scans, iterations = [], []
    try:
        for tile in tiles:
            for programs in per_sm:
                _set_tiles(tile, update_default, programs)
                same = all(torch.equal(a, b) for a, b in zip(scan(), reference, strict=True))
                scans.append((tile, programs, timed(scan, repeat), same))
        for tile in update_tiles:
            _set_tiles(scan_default, tile, default[2])
            iterations.append((tile, *swap_iterations(state, weight, gram, rows, floor, m, repeat)))
    finally:
        refit_triton.SCAN_TILE, refit_triton.OUTER_TILE, refit_triton.SCAN_PROGRAMS_PER_SM = default
    return state.z.numel() * 8, scans, iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", type=int, nargs="+", default=[4096, 14336])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 8], help="rows per width (one per width)")
    parser.add_argument("--tiles", nargs="+", default=SCAN_TILES, help="scan alone: BLOCK_KxBLOCK_Qxnum_warps")
    parser.add_argument("--per-sm", type=int, nargs="+", default=[4, 8, 16, 32], help="scan programs per SM")
    parser.add_argument("--update-tiles", nargs="+", default=UPDATE_TILES, help="update: BLOCK_AxBLOCK_Bxnum_warps")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--pattern", default="60%", help="e.g. 60%% or 2:4")
    args = parser.parse_args()
    if len(args.rows) != len(args.widths):
        raise ValueError(f"--rows needs one count per width ({len(args.widths)}), got {len(args.rows)}")
    name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(
        f"device: {name}, torch {torch.__version__}, defaults: scan tile {refit_triton.SCAN_TILE}, "
        f"{refit_triton.SCAN_PROGRAMS_PER_SM} programs per SM, update tile {refit_triton.OUTER_TILE}; "
        f"{args.pattern}"
    )
    results = []
    for d_in, n_rows in zip(args.widths, args.rows, strict=True):
        z_bytes, scans, iterations = sweep(
            d_in, n_rows, args.device, args.tiles, args.per_sm, args.update_tiles, args.repeat, args.pattern
        )
        results.append((d_in, n_rows, z_bytes, scans, iterations))
    print(f"{'d_in':>5} {'rows':>4} {'scan tile':>10} {'per SM':>6} {'scan s/row':>10} {'Z GB/s':>7} {'same':>4}")
    for d_in, n_rows, z_bytes, scans, _ in results:
        for tile, programs, seconds, same in scans:
            flag, rate = "yes" if same else "NO", z_bytes / seconds / 1e9
            print(f"{d_in:>5} {n_rows:>4} {tile:>10} {programs:>6} {seconds / n_rows:>10.3e} {rate:>7.0f} {flag:>4}")
    print(f"{'d_in':>5} {'rows':>4} {'update tile':>11} {'swap+scan it s/row':>18} {'same':>4}")
    for d_in, n_rows, _, _, iterations in results:
        for tile, seconds, same in iterations:
            print(f"{d_in:>5} {n_rows:>4} {tile:>11} {seconds / n_rows:>18.3e} {'yes' if same else 'NO':>4}")


if __name__ == "__main__":
    main()
